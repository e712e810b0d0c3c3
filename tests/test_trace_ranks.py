"""`maskcli trace` as one rank of several: each rank's part beside the target, rank 0's one report and one saved
trace of every rank, checked against masks built here by a double loop over positions; the ranks run in this
process one after the other (RANK / WORLD_SIZE as a launcher sets them), and a few jobs under torchrun itself."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from maskcli.commands import app
from launch import LAUNCHED, PROGRAMS, free_port, torchrun

runner = CliRunner()

PROGRAM = """
import os
import torch
import torch.nn.functional as F

rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
LENGTHS = [[4, 2], [3, 4], [4, 4]]
lengths = LENGTHS[rank]
keep = torch.zeros(2, 1, 4, 4, dtype=torch.bool)
for row, n in enumerate(lengths):
    keep[row, 0, :, :n] = torch.tril(torch.ones(4, 4, dtype=torch.bool))[:, :n]
x = torch.randn(2, 1, 4, 8)
for layer in range(2):
    F.scaled_dot_product_attention(x, x, x, attn_mask=keep)
if os.environ.get("FAIL") == str(rank):
    raise SystemExit(3)
"""


def reference(lengths: list[int], length: int = 4) -> np.ndarray:
    """keep[b, 0, q, k]: causal and key k real in row b, by a double loop over positions."""
    out = np.zeros((len(lengths), 1, length, length), dtype=bool)
    for b, n in enumerate(lengths):
        for q in range(length):
            for k in range(length):
                out[b, 0, q, k] = k <= q and k < n
    return out


def as_rank(rank: int, world: int, args: list[str], port: str, names=("RANK", "WORLD_SIZE"), **extra):
    """One rank's maskcli trace, in this process; a rank past 0 does not wait for rank 0 to take its part (it runs
    after it here: under a launcher the ranks run at once)."""
    env = {name: None for name in LAUNCHED} | {names[0]: str(rank), names[1]: str(world), "MASTER_PORT": port} | extra
    return runner.invoke(app, ["trace", *(["--rank-timeout", "0"] if rank else []), *args], env=env)


@pytest.fixture
def program(tmp_path) -> str:
    path = tmp_path / "prog.py"
    path.write_text(textwrap.dedent(PROGRAM))
    return str(path)


def test_rank_1_writes_its_part_silently_and_rank_0_reports_every_rank(tmp_path, program):
    from maskcli.tracefile import dense, load

    port, save, js = free_port(), str(tmp_path / "run.pt"), str(tmp_path / "run.json")
    args = ["--save", save, "--json", js, program]
    one = as_rank(1, 2, args, port)
    assert one.exit_code == 0 and one.output == ""
    assert not os.path.exists(save)
    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith(".run.pt.ranks-")]
    assert sorted(p.name for p in folder.iterdir()) == ["part-1.pkl", "started-1.json"]
    zero = as_rank(0, 2, args, port)
    assert zero.exit_code == 0, zero.output
    said = " ".join(zero.output.split())
    assert "maskcli trace prog.py (2 ranks, torchrun): 4 attention calls in 2 groups" in said
    assert "#0 causal (--lengths 4,2) · sdpa prefill, step 1 (2,1,4,4) · rank 0: prog.py:14 ×2" in said
    assert "#1 causal (--lengths 3,4) · sdpa prefill, step 1 (2,1,4,4) · rank 1: prog.py:14 ×2" in said
    assert "rank 0: 2 attention calls, exit status 0; rank 1: 2 attention calls, exit status 0" in said
    assert "the ranks differ: #0 only on rank 0; #1 only on rank 1" in said
    assert not folder.exists()  # the parts are gone once merged
    data = load(save)
    assert [(c["rank"], c["rank_index"], c["index"]) for c in data["calls"]] == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    for call in data["calls"]:
        expected = reference([[4, 2], [3, 4]][call["rank"]])
        assert np.array_equal(np.broadcast_to(dense(data["masks"][call["mask"]]), call["shape"]), expected)
    assert [r["exit_status"] for r in data["ranks"]] == [0, 0]
    written = json.loads(Path(js).read_text())
    assert [c["rank"] for c in written["calls"]] == [0, 0, 1, 1] and [g["ranks"] for g in written["groups"]] == [[0], [1]]
    shown = runner.invoke(app, ["show", "--mask", f"{save}:rank1:1"])
    assert shown.exit_code == 0 and "step 1, sdpa) · shape (B=2, H=1, Lq=4, Lk=4)" in shown.output
    assert shown.output.endswith("batch 0\n q \\ kv  0  1  2  3\n 0       1  0  0  0\n 1       1  1  0  0\n 2       1  1  1  0\n 3       1  1  1  0\n"
                                 "batch 1\n q \\ kv  0  1  2  3\n 0       1  0  0  0\n 1       1  1  0  0\n 2       1  1  1  0\n 3       1  1  1  1\n")
    assert runner.invoke(app, ["show", "--mask", f"{save}:3"]).exit_code == 0


def test_the_saved_trace_of_each_rank_is_that_rank_traced_alone(tmp_path, program):  # (Open MPI's variables)
    from maskcli.tracefile import load

    port, save = free_port(), str(tmp_path / "run.pt")
    for rank in (2, 1, 0):  # (rank 0 last: it waits for the others)
        assert as_rank(rank, 3, ["--save", save, program], port, names=("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")).exit_code == 0
    together = load(save)
    assert "Open MPI" in together["ranks"][0]["launcher"]
    for rank in range(3):
        alone = str(tmp_path / f"alone{rank}.pt")
        env = {name: None for name in LAUNCHED} | {"RANK": str(rank)}  # RANK without WORLD_SIZE: one process
        assert runner.invoke(app, ["trace", "--save", alone, program], env=env).exit_code == 0
        single = load(alone)
        mine = [c for c in together["calls"] if c["rank"] == rank]
        strip = lambda c: {k: v for k, v in c.items() if k not in ("index", "rank", "rank_index")}
        assert [strip(c) for c in mine] == [strip(c) for c in single["calls"]]
        for call in single["calls"]:
            for name, value in single["masks"][call["mask"]].items():
                assert np.array_equal(np.asarray(together["masks"][call["mask"]][name]), np.asarray(value))


def test_a_rank_that_never_reports_is_named_and_rank_0_exits_1(tmp_path, program):
    save = str(tmp_path / "run.pt")
    result = as_rank(0, 2, ["--rank-timeout", "0.2", "--save", save, program], free_port())
    assert result.exit_code == 1
    assert "rank 1: never started maskcli trace within --rank-timeout 0.2 s" in " ".join(result.output.split())
    from maskcli.tracefile import load

    assert {c["rank"] for c in load(save)["calls"]} == {0}  # what did report is kept


def test_a_rank_whose_process_died_is_named_without_waiting_out_the_timeout(tmp_path, program):
    from maskcli.trace.ranks import job

    port, save = free_port(), tmp_path / "run.pt"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    env = {name: None for name in LAUNCHED} | {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": port}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if v is not None})
    try:
        folder = job([save], sys.argv[1:]).folder
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    folder.mkdir()
    import time

    (folder / "started-1.json").write_text(json.dumps({"rank": 1, "pid": gone.pid, "host": socket.gethostname(), "started": time.time()}))
    begun = time.monotonic()
    result = as_rank(0, 2, ["--rank-timeout", "60", "--save", str(save), program], port)
    assert result.exit_code == 1 and time.monotonic() - begun < 30
    assert f"rank 1: died before its report (pid {gone.pid}): killed, or it crashed outside Python" in " ".join(result.output.split())


def test_each_ranks_exit_status_is_kept_and_reported(tmp_path, program):
    port, save = free_port(), str(tmp_path / "run.pt")
    one = as_rank(1, 2, ["--save", save, program], port, FAIL="1")
    assert one.exit_code == 3 and one.output == ""
    zero = as_rank(0, 2, ["--save", save, program], port, FAIL="1")
    assert zero.exit_code == 0
    assert "rank 0: 2 attention calls, exit status 0; rank 1: 2 attention calls, exit status 3" in " ".join(zero.output.split())


def test_a_selector_naming_a_rank_the_trace_lacks_or_a_call_every_rank_made_is_one_line(tmp_path, program):
    port, save = free_port(), str(tmp_path / "run.pt")
    as_rank(1, 2, ["--save", save, program], port)
    as_rank(0, 2, ["--save", save, program], port)
    result = runner.invoke(app, ["show", "--mask", f"{save}:rank5:0"])
    assert result.exit_code == 2 and f"{save}:rank5:0: the trace has calls of rank 0, 1, not rank 5" in " ".join(result.output.split())
    single = str(tmp_path / "one.pt")
    runner.invoke(app, ["trace", "--save", single, program], env={name: None for name in LAUNCHED})
    result = runner.invoke(app, ["show", "--mask", f"{single}:rank0:0"])
    assert result.exit_code == 2 and "the trace is of one process, with no ranks" in " ".join(result.output.split())


def test_a_rank_number_the_launcher_set_wrong_is_one_line(tmp_path, program):
    result = runner.invoke(app, ["trace", program], env={name: None for name in LAUNCHED} | {"RANK": "x", "WORLD_SIZE": "2"})
    assert result.exit_code == 2 and "RANK='x' in the environment" in result.output
    result = runner.invoke(app, ["trace", program], env={name: None for name in LAUNCHED} | {"RANK": "2", "WORLD_SIZE": "2"})
    assert result.exit_code == 2 and "RANK=2 but WORLD_SIZE=2: a rank is 0 to 1" in result.output


# --- under torchrun: a DDP training loop over gloo --------------------------------------------------------------

DDP = PROGRAMS / "ddp.py"


def ddp_reference(rank: int, width: int = 3) -> np.ndarray:
    """ddp.py's mask of rank r by a double loop: causal, a window of `width`, its lengths right-padded."""
    lengths = [6 - rank % 3, 6 - (rank + 1) % 3]
    out = np.zeros((2, 1, 6, 6), dtype=bool)
    for b, n in enumerate(lengths):
        for q in range(6):
            for k in range(6):
                out[b, 0, q, k] = k <= q and q - k < width and k < n
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_torchrun_ddp_one_report_one_trace_each_rank_as_traced_alone(tmp_path, ranks):
    from maskcli.tracefile import dense, load

    done = torchrun(ranks, ["trace", "--save", "run.pt", str(DDP)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("maskcli trace ddp.py") == 1  # one report, rank 0's
    assert f"maskcli trace ddp.py ({ranks} ranks, torchrun): {4 * ranks} attention calls" in done.stderr
    assert "rank-window" not in done.stderr and "rank-padding-side" not in done.stderr
    data = load(str(tmp_path / "run.pt"))
    assert [r["rank"] for r in data["ranks"]] == list(range(ranks)) and [r["exit_status"] for r in data["ranks"]] == [0] * ranks
    assert sorted({c["rank"] for c in data["calls"]}) == list(range(ranks))
    for call in data["calls"]:
        assert np.array_equal(np.broadcast_to(dense(data["masks"][call["mask"]]), call["shape"]), ddp_reference(call["rank"]))
    if ranks == 2:  # rank 1 traced alone (one process, its batch): the same calls and masks
        alone = str(tmp_path / "alone.pt")
        env = {name: None for name in LAUNCHED} | {"ALONE_PORT": free_port()}
        assert runner.invoke(app, ["trace", "--save", alone, str(DDP), "--as-rank", "1"], env=env).exit_code == 0
        single = load(alone)
        mine = [c for c in data["calls"] if c["rank"] == 1]
        keys = ("where", "step", "api", "shape", "mask")
        assert [[c[k] for k in keys] for c in mine] == [[c[k] for k in keys] for c in single["calls"]]


def test_torchrun_a_rank_with_another_window_is_wrong_and_named_as_docs_ranks_says(tmp_path):
    """docs/ranks.md's data-parallel command, run as written (from the repository's root), prints the report shown."""
    import re
    import shlex

    from launch import ROOT

    page = (ROOT / "docs" / "ranks.md").read_text()
    command, shown = re.search(r"```bash\n(torchrun [^\n]*ddp\.py[^\n]*)\n```\n\n<!-- torchrun report[^\n]*-->\n```text\n(.*?)\n```", page, re.S).groups()
    words = shlex.split(command)
    assert words[:5] == ["torchrun", "--nproc-per-node", "2", "--no-python", "maskcli"]
    done = torchrun(2, [w if not w.endswith(".py") else str(ROOT / w) for w in words[5:]], tmp_path, env={"COLUMNS": "80"})
    assert done.returncode == 1  # rank 0's exit status: a wrong finding (the ranks built DistributedDataParallel)
    lines = done.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("maskcli trace "))
    last = next(i for i, line in enumerate(lines) if line.startswith("wrote run.pt"))
    assert "\n".join(lines[first:last + 1]) == shown


def test_a_part_holding_anything_but_plain_values_is_not_read(tmp_path):
    import pickle

    from maskcli.trace.ranks import Job

    here = Job(0, 2, 0, "torchrun", tmp_path / "meet")
    here.begin()
    with open(here.folder / "part-1.pkl", "wb") as out:  # what a stranger could leave in a shared folder
        pickle.dump({"format": "maskcli-trace-part-1", "written": here.started, "run": os.system}, out)
    assert here._read(1) is None
    parts, missing = here.gather(0.1)
    assert parts == {} and missing == {1: "never started maskcli trace within --rank-timeout 0.1 s"}


def test_a_rank_that_started_but_sends_no_part_is_named_after_the_timeout(tmp_path, program):
    import time

    from maskcli.trace.ranks import Job

    here = Job(0, 2, 0, "torchrun", tmp_path / "meet")
    here.begin()
    (here.folder / "started-1.json").write_text(json.dumps({"rank": 1, "pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
    parts, missing = here.gather(0.2)  # this process stands for rank 1: alive, and writing nothing
    assert missing == {1: "wrote no part within --rank-timeout 0.2 s: it hangs, or its program runs on"}
    here.clean()
    assert not here.folder.exists()


def test_processes_the_program_spawns_are_its_ranks_in_one_report_and_one_trace(tmp_path):
    """torch.multiprocessing.spawn inside the traced program: each process traced as a rank, this one reporting."""
    from maskcli.tracefile import dense, load

    save = str(tmp_path / "run.pt")
    result = runner.invoke(app, ["trace", "--save", save, str(PROGRAMS / "spawn.py"), "--port", free_port()],
                           env={name: None for name in LAUNCHED})
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "maskcli trace spawn.py (2 processes, torch.multiprocessing.spawn): 2 attention calls in 2 groups" in said
    assert "rank 0: 1 attention call, exit status 0; rank 1: 1 attention call, exit status 0" in said
    data = load(save)
    assert [r["launcher"] for r in data["ranks"]] == ["torch.multiprocessing.spawn"] * 2
    for call in data["calls"]:  # rank r pads its keys from 6 - r on: a double loop over positions
        n = 6 - call["rank"]
        expected = np.array([[k <= q and k < n for k in range(6)] for q in range(6)])
        assert np.array_equal(np.broadcast_to(dense(data["masks"][call["mask"]]), call["shape"])[0, 0], expected)


def test_the_process_groups_a_rank_is_in_are_read_before_the_program_destroys_them(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # init_process_group prefixes "[rank0]:" for good

    from maskcli.trace.ranks import ProcessGroups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    with ProcessGroups() as watched:
        dist.init_process_group("gloo", rank=0, world_size=1)
        dist.new_group([0], group_desc="context parallel")
        dist.destroy_process_group()
    assert list(watched.found.values()) == [[0]] and not dist.is_initialized()


def test_torchrun_a_rank_whose_program_fails_is_in_rank_0s_report_with_its_status(tmp_path):
    """torchrun stops every rank once one exits with an error: the ranks wait for rank 0's report before exiting."""
    done = torchrun(2, ["trace", "--save", "run.pt", str(DDP), "--fail", "1"], tmp_path)
    assert done.returncode != 0  # rank 1's status, as torchrun reports it
    said = " ".join(done.stderr.split())
    assert "rank 0: 4 attention calls, exit status 0; rank 1: 4 attention calls, exit status 1" in said
    assert "RuntimeError: rank 1 fails after training" in said
    from maskcli.tracefile import load

    assert [r["exit_status"] for r in load(str(tmp_path / "run.pt"))["ranks"]] == [0, 1]


KILLED = """
import os, sys
import torch, torch.nn.functional as F
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
keep = torch.tril(torch.ones(5, 5, dtype=torch.bool))
x = torch.randn(1, 1, 5, 8)
F.scaled_dot_product_attention(x, x, x, attn_mask=keep)
dist.barrier()  # (both ranks have attended before one is killed, however late the other started)
if rank == int(sys.argv[1]):
    os.kill(os.getpid(), 9)
print(f"rank {rank} done", flush=True)
# (no destroy_process_group: the rank left would wait in it on the killed one, and a SIGTERM that comes while its
# program still runs stops it as it stops python, before any report: docs/ranks.md)
"""


@pytest.mark.parametrize("killed", [1, 0])
def test_torchrun_a_rank_that_kills_itself_is_named_by_the_report_of_the_ranks_left(tmp_path, killed):
    """hunt 9: a rank SIGKILLed (no Python runs to say so; torchrun then SIGTERMs the others) leaves no part: the
    other rank's report still comes out (rank 0's, or where rank 0 was the one killed, the rank left's), naming the
    killed rank, and the trace holds the calls that arrived; torchrun's exit status is the one it gives untraced."""
    from maskcli.tracefile import dense, load

    path = tmp_path / "killed.py"
    path.write_text(textwrap.dedent(KILLED))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHED} | {"OMP_NUM_THREADS": "1"}
    plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                            free_port(), str(path), str(killed)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=240)
    done = torchrun(2, ["trace", "--save", "run.pt", str(path), str(killed)], tmp_path)
    assert done.returncode == plain.returncode != 0, (done.returncode, plain.returncode)
    assert done.stdout == plain.stdout == f"rank {1 - killed} done\n", (done.stdout, plain.stdout)
    said = " ".join(done.stderr.split())
    assert "maskcli trace killed.py (2 ranks, torchrun): 1 attention call" in said, done.stderr[-3000:]
    assert f"rank {1 - killed}: 1 attention call, exit status 0" in said
    assert f"rank {killed}: died before its report" in said and "wrote run.pt (1 rank of 2)" in said
    assert said.count("maskcli trace killed.py") == 1
    data = load(str(tmp_path / "run.pt"))
    assert [c["rank"] for c in data["calls"]] == [1 - killed]
    causal = np.array([[k <= q for k in range(5)] for q in range(5)])
    assert np.array_equal(np.broadcast_to(dense(data["masks"][data["calls"][0]["mask"]]), (1, 1, 5, 5))[0, 0], causal)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run.pt.ranks-")]  # (the parts removed)


def test_a_spawned_process_stopped_as_another_is_killed_still_reports_its_calls(tmp_path):
    """hunt 9: torch.multiprocessing.spawn SIGTERMs the other processes once one is killed: one that has returned
    from its function writes its part first, so the report has its calls and names the killed one."""
    path = tmp_path / "spawnkill.py"
    path.write_text(textwrap.dedent("""
        import os, sys, time
        import torch, torch.nn.functional as F
        import torch.multiprocessing as mp

        def work(rank):
            x = torch.randn(1, 1, 5, 8)
            F.scaled_dot_product_attention(x, x, x, attn_mask=torch.tril(torch.ones(5, 5, dtype=torch.bool)))
            if rank == 0:
                open(FLAG, "w").close()  # (rank 1 waits for it: on a loaded machine rank 0 may start late)
            if rank == 1:
                for _ in range(1200):
                    if os.path.exists(FLAG):
                        break
                    time.sleep(0.1)
                time.sleep(0.5)
                os.kill(os.getpid(), 9)

        if __name__ == "__main__":
            try:
                mp.spawn(work, nprocs=2)
            except Exception as error:
                print(type(error).__name__)
                sys.exit(5)
    """).replace("FLAG", repr(str(tmp_path / "attended"))))
    save = str(tmp_path / "run.pt")
    result = runner.invoke(app, ["trace", "--save", save, str(path)], env={name: None for name in LAUNCHED})
    assert result.exit_code == 5, result.output
    said = " ".join(result.output.split())
    assert "rank 0: 1 attention call, exit status 0" in said and "rank 1: died before its report" in said, said


def test_a_sigterm_while_a_spawned_process_writes_its_part_is_held_until_it_is_written(tmp_path):
    """The part is written whole, then the SIGTERM delivered as it came: the process ends by it (status -15)."""
    from launch import ROOT

    script = tmp_path / "held.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from maskcli.trace.spawned import _held_term
        with _held_term():
            os.kill(os.getpid(), signal.SIGTERM)
            open({str(tmp_path / "part")!r}, "w").write("whole")
        print("not reached")
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == -15 and done.stdout == "" and (tmp_path / "part").read_text() == "whole"


def test_wrong_findings_at_a_context_parallel_part_are_left_out_and_counted(tmp_path):
    """picotron's ring attention (tests/data/quiet_blind, written blind, correct): rank 1's second call attends rank 0's
    block in full, which is right for earlier tokens, and sees-its-target read its columns as positions 0..7 (its
    queries' targets among them). At a site whose keys came from other ranks no wrong finding is made; the report
    says how many were left out and where such parts are checked."""
    pytest.importorskip("transformers")  # (its tiny Llama is built from transformers' LlamaConfig: the hf extra)
    program = Path(__file__).parent / "data" / "quiet_blind" / "quiet_picotron_ring_attention_cp2_gloo_train_step.py"
    out = tmp_path / "run.json"
    done = subprocess.run([sys.executable, "-m", "maskcli", "trace", "--json", str(out), str(program)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 0, said
    assert ("1 wrong finding left out at call sites whose keys came from other ranks (the program passed tensors "
            "between ranks before them") in said
    assert [f for g in json.loads(out.read_text())["groups"] for f in g["findings"] if f["severity"] != "note"] == []
