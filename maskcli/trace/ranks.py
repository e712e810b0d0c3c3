"""A traced program that runs as one rank of many (torchrun, mpirun): each rank's part written beside the target,
and rank 0 waiting for every part to report on them all at once.

Each rank is a `maskcli trace` of its own, started by the launcher; they share no memory and, before the
program sets one up, no process group, so they meet on the file system: a folder beside the --save/--json
target (the temp folder where there is none), named by the job (the launcher's run id, master address and
port, the world size, the command). Each rank writes `started-R.json` as it begins and `part-R.pkl` when its
program ends (atomically: a part is whole or absent); rank 0 waits for every part, naming a rank that died
(its process gone, on this host) or wrote none within the timeout, then reports and removes the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from maskcli.errors import MaskError

PART = "maskcli-trace-part-1"
# (rank, world size, local rank) as each launcher sets them, and the launcher's name
LAUNCHERS = (("RANK", "WORLD_SIZE", "LOCAL_RANK", "torchrun"),
             ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI"),
             ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "an MPI launcher (PMI)"))
JOB_IDS = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMI_JOBID")
POLL = 0.05  # seconds between looks for the other ranks' parts


@dataclass
class Job:
    """This process's place in a job of several ranks, and the folder where the ranks meet."""

    rank: int
    world: int
    local_rank: int | None
    launcher: str
    folder: Path
    started: float = field(default_factory=time.time)
    groups: list = field(default_factory=list)  # the process groups (their global ranks) this rank is in, past the world

    def begin(self) -> None:
        """The folder made, and this rank's start said in it (so that rank 0 can tell a rank that died from a slow one)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            _write_json(self.folder / f"started-{self.rank}.json",
                        {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "started": self.started})
        except OSError as error:
            raise MaskError(f"rank {self.rank}: cannot write beside the target in {str(self.folder)!r} ({error.strerror or error}): "
                            "every rank writes its part there; give --save or --json a folder every rank can write") from None

    def write(self, part: dict) -> None:
        """This rank's part, whole or not at all (a temp file renamed over it): a pickle of plain types and numpy
        arrays, which rank 0 reads back allowing nothing else (Parts) and at C speed, where torch.load's
        weights_only reader took 8 ms for a part of 36 calls."""
        data = {**part, "format": PART, "rank": self.rank, "world": self.world, "written": time.time()}
        target = self.folder / f"part-{self.rank}.pkl"
        temp = self.folder / f".part-{self.rank}.{os.getpid()}.tmp"
        with open(temp, "wb") as out:
            pickle.dump(data, out, protocol=5)
        os.replace(temp, target)

    def gather(self, timeout: float) -> tuple[dict[int, dict], dict[int, str]]:
        """({rank: part} of the other ranks, {rank: why it has none}) once every rank wrote one, died, or `timeout`
        seconds passed. The parts stay until clean(): the ranks that wrote them wait for that (wait_taken)."""
        parts: dict[int, dict] = {}
        dead: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        waiting = set(range(self.world)) - {self.rank}
        while waiting:
            for r in sorted(waiting):
                found = self._read(r)
                if found is not None:
                    parts[r] = found
                    waiting.discard(r)
                    continue
                why = self._died(r)
                if why is not None:
                    dead[r] = why
                    waiting.discard(r)
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(POLL)
        for r in sorted(waiting):
            began = self._marker(r)
            dead[r] = (f"wrote no part within --rank-timeout {timeout:g} s: it hangs, or its program runs on"
                       if began is not None else f"never started maskcli trace within --rank-timeout {timeout:g} s")
        return parts, dead

    def wait_taken(self, timeout: float) -> None:
        """Wait until rank 0 has reported (it removes the parts), or `timeout` seconds: a launcher that sees one rank
        exit with an error stops the others (torchrun does), which would stop rank 0 before its report."""
        deadline = time.monotonic() + timeout
        mine = self.folder / f"part-{self.rank}.pkl"
        while mine.exists() and time.monotonic() < deadline:
            time.sleep(POLL)

    def clean(self) -> None:
        for path in self.folder.glob("*"):
            if path.name.startswith(("part-", "started-", ".part-", ".started-")):
                path.unlink(missing_ok=True)
        try:
            self.folder.rmdir()
        except OSError:
            pass  # a rank still writing (it will be named), or files that are not ours

    def _marker(self, r: int) -> dict | None:
        try:
            found = json.loads((self.folder / f"started-{r}.json").read_text())
        except (OSError, ValueError):
            return None
        return found if found.get("started", 0) >= self.started - STALE else None

    def _read(self, r: int) -> dict | None:
        path = self.folder / f"part-{r}.pkl"
        if not path.exists():
            return None
        try:
            with open(path, "rb") as handle:
                data = Parts(handle).load()
        except (OSError, EOFError, ValueError, pickle.UnpicklingError):
            return None
        if not isinstance(data, dict) or data.get("format") != PART or data.get("written", 0) < self.started - STALE:
            return None  # a part left by an earlier job that died: not this one's
        return data

    def _died(self, r: int) -> str | None:
        """Why rank r will write no part, where its process is known gone (on this host); None while it may."""
        began = self._marker(r)
        if began is None or began.get("host") != socket.gethostname():
            return None
        try:
            os.kill(int(began["pid"]), 0)
        except ProcessLookupError:
            if self._read(r) is None:  # (it may have written its part as it exited)
                return f"died before its report (pid {began['pid']}): killed, or it crashed outside Python"
        except (PermissionError, OSError, ValueError):
            return None
        return None


class Parts(pickle.Unpickler):
    """A part read back allowing only plain types and numpy arrays (a folder others can write to holds no code)."""

    ALLOWED = {("numpy", "dtype"), ("numpy", "ndarray"), ("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer"),
               ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"a part holds {module}.{name}, which is no plain value")
        return super().find_class(module, name)


STALE = 60.0  # seconds: a part or start written this long before this rank began is an earlier job's


def _write_json(path: Path, data: dict) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(data))
    os.replace(temp, path)


def _number(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise MaskError(f"{name}={text!r} in the environment: the launcher's rank and world size are whole numbers") from None
    return value


def job(targets: list[Path], argv: list[str], environ=os.environ) -> Job | None:
    """This process's rank and world where a launcher started several (None for one process), meeting beside the
    first target (or in the temp folder)."""
    for rank_name, world_name, local_name, launcher in LAUNCHERS:
        if rank_name in environ and world_name in environ:
            rank, world = _number(rank_name, environ[rank_name]), _number(world_name, environ[world_name])
            local = _number(local_name, environ[local_name]) if local_name in environ else None
            break
    else:
        return None
    if world <= 1:
        return None
    if not 0 <= rank < world:
        raise MaskError(f"{rank_name}={rank} but {world_name}={world}: a rank is 0 to {world - 1}")
    identity = [f"{name}={environ.get(name, '')}" for name in JOB_IDS] + [str(world), os.getcwd(), *argv]
    key = hashlib.blake2b("\0".join(identity).encode(), digest_size=8).hexdigest()
    if targets:
        folder = targets[0].parent / f".{targets[0].name}.ranks-{key}"
    else:
        folder = Path(tempfile.gettempdir()) / f"maskcli-ranks-{key}"
    return Job(rank, world, local, launcher, folder)


# what hands one rank's tensors to another (not all_reduce: DDP's gradients); isend and irecv stay as they are, as
# P2POp checks that it was given those very functions (batch_isend_irecv, which runs them, is noted instead)
EXCHANGES = ("all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single", "send", "recv", "batch_isend_irecv")


class ProcessGroups:
    """The process groups this rank is in beside the world (a data- and a context-parallel group), read before the
    program destroys them and again as it ends: {name: its global ranks}; whether it built a DistributedDataParallel
    (`replicated`: the ranks say they run one model); and `exchanged`: the numbers of the attention calls that came
    next after the program passed tensors between ranks (all_gather, send / recv, all_to_all: keys and values, where
    ranks hold parts of one sequence). `calls()` says how many calls were recorded so far."""

    def __init__(self, calls=lambda: 0):
        self.found: dict[str, list[int]] = {}
        self.replicated = False
        self.exchanged: set[int] = set()
        self._calls = calls
        self._undo: list = []

    def __enter__(self) -> ProcessGroups:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        built = DistributedDataParallel.__init__

        def init(module, *args, **kwargs):
            self.replicated = True
            return built(module, *args, **kwargs)

        DistributedDataParallel.__init__ = init
        self._undo.append(lambda: setattr(DistributedDataParallel, "__init__", built))
        if not dist.is_available():
            return self
        original = dist.destroy_process_group

        def destroy(*args, **kwargs):  # (the program's own call: the groups are read before they go)
            self.snapshot()
            return original(*args, **kwargs)

        self._swap(dist, "destroy_process_group", destroy)
        for name in EXCHANGES:
            function = getattr(dist, name, None)
            if function is not None:
                self._swap(dist, name, self._noting(function))
        return self

    def _swap(self, module, name: str, replacement) -> None:
        original = getattr(module, name)
        setattr(module, name, replacement)
        self._undo.append(lambda: setattr(module, name, original))

    def _noting(self, function):
        def exchange(*args, **kwargs):
            self.exchanged.add(self._calls())
            return function(*args, **kwargs)

        return exchange

    def __exit__(self, *exc) -> None:
        self.snapshot()
        while self._undo:
            self._undo.pop()()

    def snapshot(self) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return
        from torch.distributed import distributed_c10d as c10d

        world = c10d._get_default_group()
        for group, ranks in list(c10d._world.pg_group_ranks.items()):
            if group is world:
                continue
            members = sorted(int(r) for r in ranks)
            name = c10d._world.pg_names.get(group, "") or f"group {len(self.found)}"
            if members not in self.found.values():
                self.found[name] = members
