"""maskcli.trace.threads: attention calls made in the threads a program starts are traced as the main thread's are;
threads running before the trace and child processes are named as not traced."""

from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

import maskcli


def attend(length: int) -> torch.Tensor:
    q = torch.randn(1, 2, length, 4)
    return F.scaled_dot_product_attention(q, q, q, is_causal=True)


class Worker(threading.Thread):  # a subclass with its own run(), as many programs write threads
    def run(self):
        attend(7)


def test_calls_in_threads_the_program_starts_are_all_seen_with_their_masks():
    """A TorchFunctionMode is per thread (torch/overrides.py, _push_mode on the thread's mode stack): three threads,
    two pool workers, a Thread subclass and the main thread each call SDPA once; every call is seen."""
    with maskcli.trace() as t:
        threads = [threading.Thread(target=attend, args=(n,), name=f"worker-{n}") for n in (3, 4, 5)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        together = threading.Barrier(2)  # both tasks at once: two workers, whatever the scheduler does

        def paired(length):
            together.wait(10)
            return attend(length)

        with ThreadPoolExecutor(2, thread_name_prefix="pool") as pool:
            list(pool.map(paired, [8, 9]))
        worker = Worker(name="subclass")
        worker.start()
        worker.join()
        attend(2)
    assert sorted(c.shape[2] for c in t.calls) == [2, 3, 4, 5, 7, 8, 9]
    for call in t.calls:
        assert np.array_equal(call.keep()[0, 0], np.tril(np.ones((call.shape[2],) * 2, dtype=bool)))
    threads_of = {c.shape[2]: c.details.get("thread") for c in t.calls}
    assert threads_of[2] is None and threads_of[3] == "worker-3" and threads_of[7] == "subclass"
    assert threads_of[8].startswith("pool") and threads_of[9].startswith("pool")
    (note,) = t.notes()
    head, names = note.split(": ")
    assert head == "6 threads the program started made attention calls, traced as well"
    assert sorted(names.split(", ")) == ["pool_0", "pool_1", "subclass", "worker-3", "worker-4", "worker-5"]
    assert attend(3).shape == (1, 2, 3, 4) and threading.Thread._bootstrap_inner.__name__ == "_bootstrap_inner"


def test_a_thread_running_before_the_trace_is_named_as_not_traced():
    go, done = threading.Event(), threading.Event()

    def waiting():
        go.wait(10)
        attend(4)
        done.set()

    early = threading.Thread(target=waiting, name="started-early")
    early.start()
    with maskcli.trace() as t:
        go.set()
        done.wait(10)
    early.join()
    assert t.calls == []  # its call is not seen: the note says why
    assert t.notes() == ["1 thread running before the trace began not traced (their calls are not in this report): started-early"]
    assert t.report() == "0 attention calls in 0 groups\n" + t.notes()[0]


def test_torchs_compile_pool_worker_running_before_the_trace_is_not_named(monkeypatch):
    """Inductor compiles its kernels in a cached ThreadPoolExecutor whose non-daemon worker stays for the process
    (torch/_inductor/async_compile.py, AsyncCompile.pool): torch's helper, not a program's thread; a program's own
    thread running beside it is still named."""
    import torch._inductor.config
    from torch._inductor.async_compile import AsyncCompile

    monkeypatch.setattr(torch._inductor.config, "compile_threads", 2)  # (the pool needs more than one)
    assert AsyncCompile.pool().submit(threading.get_ident).result() != threading.get_ident()
    workers = [t for t in threading.enumerate() if t.name.startswith("ThreadPoolExecutor") and not t.daemon]
    assert workers and all(t.is_alive() for t in workers)
    go = threading.Event()
    early = threading.Thread(target=go.wait, args=(10,), name="started-early")
    early.start()
    with maskcli.trace() as t:
        attend(3)
    go.set()
    early.join()
    assert [c.shape[2] for c in t.calls] == [3]
    assert t.notes() == ["1 thread running before the trace began not traced (their calls are not in this report): started-early"]


def work() -> None:
    """A child's work (no torch: GNU OpenMP's threads do not survive a fork of a process that used them)."""


def test_child_processes_are_counted_and_named_as_not_traced():
    with maskcli.trace() as t:
        child = multiprocessing.get_context("fork").Process(target=work, name="forked")
        child.start()
        child.join()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    assert child.exitcode == 0 and t.calls == []
    assert t.notes() == ["2 child processes not traced (they run in memory of their own; trace the code they run on its own): "
                         "forked (work), os.fork()"]


def test_python_subprocesses_are_named_and_a_launchers_ranks_say_how_to_trace_them():
    """subprocess.Popen of Python (torchrun's agent starts each rank so, RANK in its environment) is a child process not
    traced, named by what it runs; another program (git, a compiler) is none of the program's code and is not named."""
    import subprocess
    import sys

    with maskcli.trace() as t:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        for rank in (0, 1):
            subprocess.run([sys.executable, "-u", "-c", "pass"], env={**os.environ, "RANK": str(rank)}, check=True)
        subprocess.run(["true"], check=True)
    assert t.calls == [] and t.notes() == [
        "3 child processes not traced (they run in memory of their own; trace the code they run on its own): python -c, "
        "rank 0: python -c, rank 1: python -c",
        "a launcher's ranks run in processes of their own: run the launcher on maskcli trace, which traces every rank and "
        "reports them together (torchrun --nproc-per-node 2 --no-python maskcli trace SCRIPT.py)"]
    subprocess.run(["true"], check=True)  # (the trace over: Popen as it was)
    assert subprocess.Popen.__init__.__module__ == "subprocess"


def test_how_a_subprocess_is_named():
    from maskcli.trace.threads import python_child

    assert python_child(["python3", "train.py", "--lr", "1"], None) == "python train.py"
    assert python_child(["/usr/bin/python3.11", "-X", "dev", "-m", "pkg.mod", "x"], {"RANK": "3"}) == "rank 3: python -m pkg.mod"
    assert python_child("python eval.py --fast", None) == "python eval.py"
    assert python_child(["git", "rev-parse", "HEAD"], None) is None and python_child([], None) is None


def test_torchs_own_compile_workers_are_not_named(monkeypatch):
    """A Popen that torch's own code starts (inductor's compile workers: `python -c ...` from torch/_inductor) is torch's
    helper, not the program's child, as torch's pool threads are; one with a RANK (a launcher's rank) still is."""
    import subprocess
    import sys
    import types

    import torch

    source = "def start(args, env=None):\n    return subprocess.run(args, env=env, check=True)\n"
    module = types.ModuleType("fake_torch_pool")
    module.subprocess = subprocess
    exec(compile(source, os.path.join(os.path.dirname(torch.__file__), "_fake_pool.py"), "exec"), module.__dict__)
    with maskcli.trace() as t:
        module.start([sys.executable, "-c", "pass"])
        module.start([sys.executable, "-c", "pass"], env={**os.environ, "RANK": "0"})
    assert t.notes()[0] == ("1 child process not traced (they run in memory of their own; trace the code they run on "
                            "its own): rank 0: python -c")


def test_an_installed_librarys_own_module_run_as_a_child_is_not_named(monkeypatch, tmp_path):
    """vLLM inspects a model class in a child process (`python -m vllm.model_executor.models.registry`, started by
    vllm/model_executor/models/registry.py where its cache has no entry): an installed library running a module of its
    own is its helper, not the program's child. The same command from the program's own code is named, as is a
    library's child running another package's module."""
    import subprocess
    import sys

    import maskcli.trace.threads as threads

    site = tmp_path / "site-packages"
    (site / "fakelib").mkdir(parents=True)
    (site / "fakelib" / "__init__.py").write_text("")
    (site / "fakelib" / "__main__.py").write_text("")
    (site / "fakelib" / "registry.py").write_text(
        "import subprocess, sys\n"
        "def inspect(module):\n"
        "    subprocess.run([sys.executable, '-m', module], check=True)\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))  # (the children import it as well)
    monkeypatch.setattr(threads, "_SITE_DIRS", [str(site)])
    monkeypatch.delitem(sys.modules, "fakelib.registry", raising=False)
    import fakelib.registry

    with maskcli.trace() as t:
        fakelib.registry.inspect("fakelib")  # (its own: not named)
        fakelib.registry.inspect("this")  # (another's module: named)
        subprocess.run([sys.executable, "-m", "fakelib"], check=True)  # (the program's own call: named)
    assert t.notes() == ["2 child processes not traced (they run in memory of their own; trace the code they run on "
                         "its own): python -m this, python -m fakelib"]
    monkeypatch.setattr(threads, "_SITE_DIRS", [])
    with maskcli.trace() as t:
        fakelib.registry.inspect("fakelib.registry")  # (not installed where Python installs libraries: the program's)
    assert t.notes()[0].endswith("python -m fakelib.registry")
