"""The threads and processes a traced program starts: each thread traced as the main one is, each process counted.

The trace records the threads it was entered in (a thread's TorchFunctionMode, where one is
needed, is on that thread's stack only). While tracing, every thread started is entered as
it begins (threading.Thread._bootstrap_inner, which threading, concurrent.futures'
ThreadPoolExecutor and every Thread subclass go through before run()). Threads already
running when the trace began are not entered: they are named (not daemon threads: those
are libraries' helpers, such as the progress monitor torch.compile starts, far more often
than a program's workers, which threading and ThreadPoolExecutor start as non-daemon; nor
the workers of torch's own pools, such as inductor's compile pool, non-daemon but torch's). Child processes
(multiprocessing, ProcessPoolExecutor, os.fork) run in memory of their own, where nothing
of this trace reaches: they are counted and named, as not traced.
"""

from __future__ import annotations

import os
import threading

_ACTIVE: list = []  # the Threads of the traces running (os.register_at_fork cannot be undone: it asks this list)
_FORKING = threading.local()  # inside multiprocessing's start(): its fork is the process counted there


def _forked() -> None:
    if not getattr(_FORKING, "on", False):
        for watch in _ACTIVE:
            watch.processes.append("os.fork()")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_forked)


class Threads:
    """While entered: threads started run inside `make_mode()` (a context: the trace entered in that thread); processes
    started are noted in .processes."""

    def __init__(self, make_mode):
        self.make_mode = make_mode
        self.before: list[str] = []  # names of the threads running when the trace began, not traced
        self.processes: list[str] = []
        self._undo: list = []
        self._lock = threading.Lock()

    def __enter__(self) -> Threads:
        current = threading.current_thread()
        helpers = _torch_helpers()
        self.before = [t.name for t in threading.enumerate()
                       if t is not current and t.is_alive() and not t.daemon and t not in helpers]
        bootstrap = threading.Thread._bootstrap_inner
        watch = self

        def _bootstrap_inner(thread):
            mode = watch.make_mode()
            if mode is None:  # the trace has ended
                return bootstrap(thread)
            mode.__enter__()
            try:
                return bootstrap(thread)
            finally:
                mode.__exit__(None, None, None)

        threading.Thread._bootstrap_inner = _bootstrap_inner
        self._undo.append(lambda: setattr(threading.Thread, "_bootstrap_inner", bootstrap))
        import multiprocessing.process

        start = multiprocessing.process.BaseProcess.start

        def start_(process):
            with watch._lock:
                target = getattr(getattr(process, "_target", None), "__qualname__", None)
                watch.processes.append(f"{process.name} ({target})" if target else process.name)
            _FORKING.on = True
            try:
                return start(process)
            finally:
                _FORKING.on = False

        multiprocessing.process.BaseProcess.start = start_
        self._undo.append(lambda: setattr(multiprocessing.process.BaseProcess, "start", start))
        import subprocess

        popen = subprocess.Popen.__init__

        def popen_(process, args, *rest, **kwargs):
            name = python_child(args, kwargs.get("env"))
            if name is not None and not name.startswith("rank ") and _a_librarys_own(name):
                name = None  # (torch's own workers, vLLM's model inspection: not the program's, as a pool's threads)
            if name is not None:
                with watch._lock:
                    watch.processes.append(name)
            return popen(process, args, *rest, **kwargs)

        subprocess.Popen.__init__ = popen_
        self._undo.append(lambda: setattr(subprocess.Popen, "__init__", popen))
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        while self._undo:
            self._undo.pop()()

    def notes(self, calls: list) -> list[str]:
        """What the report says of them: the threads started that made attention `calls` (traced), threads and
        processes not traced. (Threads that made none are not named: a library's helper thread is nothing to see.)"""
        found = []
        made = list(dict.fromkeys(call.details["thread"] for call in calls if "thread" in call.details))
        if made:
            found.append(f"{_count(len(made), 'thread')} the program started made attention calls, traced as well: {_names(made)}")
        if self.before:
            found.append(f"{_count(len(self.before), 'thread')} running before the trace began not traced (their calls "
                         f"are not in this report): {_names(self.before)}")
        if self.processes:
            found.append(f"{_count(len(self.processes), 'child process', 'child processes')} not traced (they run in "
                         f"memory of their own; trace the code they run on its own): {_names(self.processes)}")
        if any(name.startswith("rank ") for name in self.processes):
            found.append("a launcher's ranks run in processes of their own: run the launcher on maskcli trace, which "
                         "traces every rank and reports them together (torchrun --nproc-per-node 2 --no-python maskcli "
                         "trace SCRIPT.py)")
        return found


def _a_librarys_own(name: str) -> bool:
    """The subprocess.Popen running now (a Python child, `name`) is a library's helper, not the program's child: started
    by torch's own code (the first frame outside subprocess.py and this module is torch's: inductor's compile workers),
    or by an installed library's code to run a module of that same library (`python -m vllm.model_executor.models.registry`
    from vllm/model_executor/models/registry.py: vLLM inspects a model class in a child process where its cache has no
    entry for it)."""
    import sys
    import sysconfig

    import torch

    frame, here, torch_dir = sys._getframe(2), os.path.dirname(__file__), os.path.dirname(torch.__file__)
    while frame is not None and frame.f_code.co_filename.endswith("subprocess.py"):
        frame = frame.f_back
    if frame is None:
        return False
    if frame.f_code.co_filename.startswith((torch_dir + os.sep, here + os.sep)):
        return True
    module = name[len("python -m "):].split()[0] if name.startswith("python -m ") else ""
    starter = str(frame.f_globals.get("__name__") or "")
    installed = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")} | set(_SITE_DIRS)
    return (bool(module) and module.split(".")[0] == starter.split(".")[0]
            and frame.f_code.co_filename.startswith(tuple(os.path.join(path, "") for path in installed)))


_SITE_DIRS: list[str] = []  # further folders of installed libraries (tests add one)


def python_child(args, env) -> str | None:
    """How the report names a subprocess.Popen that runs Python (`python SCRIPT` or `python -m MODULE`, `rank N: ...`
    where its environment gives it a RANK, as torchrun's agent starts its workers); None for any other program (a
    program's `git` or compiler is no code of its own to trace)."""
    import sys

    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args or ())
    if not argv:
        return None
    words = [os.fsdecode(word) if isinstance(word, (bytes, os.PathLike)) else str(word) for word in argv]
    if len(words) == 1:
        words = words[0].split()  # (one string: a shell line, or a program alone)
    if not words or not (os.path.basename(words[0]).startswith("python") or words[0] == sys.executable):
        return None
    rest = words[1:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        rest = rest[2:] if rest[0] in ("-X", "-W") else rest[1:]  # (python's own flags: -u, -X dev)
    program = " ".join(rest[:2]) if rest[:1] == ["-m"] else "-c" if rest[:1] == ["-c"] else rest[0] if rest else ""
    name = f"python {program}".strip()
    rank = (env or {}).get("RANK") if isinstance(env, dict) else None
    return f"rank {rank}: {name}" if rank is not None else name


def _torch_helpers() -> set:
    """The worker threads of torch's own thread pools, made once per process and idle between their tasks: inductor's
    compile pool (torch._inductor.async_compile.AsyncCompile.pool, cached, non-daemon: made as the first kernel is
    compiled, it stays for the process) and the prefetch pool of torch.utils._functools. A library's helpers, not the
    program's workers, whatever ran before the trace (named otherwise as a thread not traced, a false note)."""
    import sys

    found: set = set()
    compiling = getattr(sys.modules.get("torch._inductor.async_compile"), "AsyncCompile", None)
    pool = getattr(compiling, "pool", None)
    try:  # (only a pool already made: asking the cache for it makes none)
        if pool is not None and pool.cache_info().currsize:
            found.update(getattr(pool(), "_threads", ()))
    except Exception:  # noqa: BLE001 - another torch's pool: its threads are named as any other
        pass
    prefetch = getattr(sys.modules.get("torch.utils._functools"), "_prefetch_executor", None)
    found.update(getattr(prefetch, "_threads", ()))
    return found


def _count(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:6])
    return shown + (f" and {len(names) - 6} more" if len(names) > 6 else "")
