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

import contextlib
import hashlib
import json
import os
import pickle
import signal
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
    stopped: float | None = None  # when a SIGTERM came after the program ended (the launcher stops the job: a rank failed)
    failed_first: bool = False  # this rank reports on what is there at once: its program failed while the others ran

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

    def gather(self, timeout: float, status: int = 0) -> tuple[dict[int, dict], dict[int, str]]:
        """({rank: part} of the other ranks, {rank: why it has none}) once every rank wrote one, died, or `timeout`
        seconds passed. The parts stay until clean(): the ranks that wrote them wait for that (wait_taken). A rank
        that reports in rank 0's place because its own program failed while rank 0's still ran (wait_taken) takes
        what is there at once: the others may be waiting on it in a collective; rank 0 whose own program failed
        (`status`) waits FAILED seconds at most, for the same reason (untraced, the launcher would stop them now)."""
        parts: dict[int, dict] = {}
        dead: dict[int, str] = {}
        if self.failed_first:
            timeout = 0.0
        elif status and self.rank == 0 and timeout > FAILED:
            timeout, self.failed_first = FAILED, True
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
            if not waiting or time.monotonic() > deadline or self.stopped is not None:
                break  # (stopped: this pass, made after the signal, was the last: what arrived is reported at once)
            time.sleep(POLL)
        for r in sorted(waiting):
            began = self._marker(r)
            dead[r] = (f"was still in its program when rank {self.rank}'s failed (the launcher then stops every rank, "
                       "as it does untraced): its calls are not in this report" if self.failed_first else
                       f"sent no part before the launcher stopped the job (SIGTERM, as it does once a rank fails): it "
                       "failed, was killed, or its program still ran (its status is in the launcher's log)"
                       if self.stopped is not None else
                       f"wrote no part within --rank-timeout {timeout:g} s: it hangs, or its program runs on"
                       if began is not None else f"never started maskcli trace within --rank-timeout {timeout:g} s")
        return parts, dead

    def wait_taken(self, timeout: float, status: int = 0) -> bool:
        """Wait until rank 0 has reported (it removes the parts), or `timeout` seconds: a launcher that sees one rank
        exit with an error stops the others (torchrun does), which would stop rank 0 before its report. Whether this
        rank is to report instead (having claimed the report first: a file made only once, so one rank reports):
        rank 0 died before its report (killed: no Python ran to say so) while this rank's part waits; or this rank's
        program failed (`status`) and rank 0's has not ended within FAILED seconds (it claims the report then) (it may wait on this rank in a
        collective, as untraced it would until the launcher stopped it: so this rank reports what there is, and
        exits as it would have)."""
        began = time.monotonic()
        deadline = began + timeout
        mine = self.folder / f"part-{self.rank}.pkl"
        while mine.exists() and time.monotonic() < deadline:
            if self._died(0) is not None and mine.exists():
                return self._claim()
            if status and time.monotonic() > began + FAILED and mine.exists() and self._claim():
                self.failed_first = True  # (rank 0 claims the report as its program ends: it had not)
                return True
            if self.stopped is not None:
                deadline = min(deadline, self.stopped + GRACE)
            time.sleep(POLL)
        return False

    def claim(self) -> bool:
        """Whether this rank is the one to report (rank 0 claims it as its program ends; a rank that reports in its
        place, first): where another claimed it, this rank's report is not made."""
        if self._claim():
            return True
        try:
            return (self.folder / "reporter").read_text() == str(os.getpid())
        except OSError:
            return True  # (no folder left to say: nobody else reported)

    def _claim(self, again: bool = True) -> bool:
        path = self.folder / "reporter"
        try:
            made = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except OSError:
            try:
                pid = int(path.read_text() or "0")
            except (OSError, ValueError):
                return False
            if again and pid and pid != os.getpid() and _gone(pid):  # (it claimed it, then was killed: take it over)
                path.unlink(missing_ok=True)
                return self._claim(again=False)
            return False
        os.write(made, str(os.getpid()).encode())
        os.close(made)
        return True

    def stop(self, number, frame) -> None:
        """The SIGTERM handler from the program's end on (signals()): the waiting ends, the report comes out."""
        self.stopped = time.monotonic()

    def ended(self, world) -> None:
        """The program has ended: from now on a SIGTERM ends the waiting (signals()), here and once `world` (run.World,
        leaving) puts back maskcli's handlers, so that none comes between the program's end and the report. Rank 0
        says so in the folder (the other ranks' wait_taken reads it)."""
        if self.rank == 0:
            self._claim()  # (where a rank whose program failed claimed it first, claim() says so at the report)
        try:
            signal.signal(signal.SIGTERM, self.stop)
        except (ValueError, OSError):  # (not the main thread)
            return
        if signal.SIGTERM in world.ours:
            self._before = world.ours[signal.SIGTERM]  # (maskcli's: signals() puts it back once the report is made)
            world.ours[signal.SIGTERM] = self.stop

    @contextlib.contextmanager
    def signals(self):
        """While the parts are written, gathered and reported: a SIGTERM (the launcher stopping the job because a rank
        failed or was killed) ends the waiting, not the process, so the report of what arrived still comes out; the
        handler before is put back after."""
        try:
            before = signal.signal(signal.SIGTERM, self.stop)
        except (ValueError, OSError):  # (not the main thread)
            yield
            return
        before = getattr(self, "_before", before)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)

    def clean(self) -> None:
        for path in self.folder.glob("*"):
            if path.name.startswith(("part-", "started-", ".part-", ".started-", "reporter")):
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
            pid = int(began["pid"])
            os.kill(pid, 0)
        except ProcessLookupError:
            pass
        except (PermissionError, OSError, ValueError, TypeError, KeyError):
            return None
        else:
            if not _zombie(pid):  # (killed, but not yet reaped by the launcher: gone all the same)
                return None
        if r != self.rank and self._read(r) is None:  # (it may have written its part as it exited)
            return f"died before its report (pid {began['pid']}): killed, or it crashed outside Python"
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


FAILED = 5.0  # seconds a rank whose program failed waits for rank 0's program to end before it reports instead
GRACE = 20.0  # seconds a rank waits on for rank 0's report after a SIGTERM (torchrun kills at 30)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether process `pid` has ended and waits to be reaped (Linux's /proc; elsewhere: not known, so no)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[:1] == [b"Z"]
    except (OSError, IndexError):
        return False


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
