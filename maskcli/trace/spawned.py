"""Processes the traced program starts itself with torch.multiprocessing.spawn (or start_processes): each traced as
a rank of its own, and the program's process reporting on them all as rank 0 does under a launcher.

spawn runs `fn(i, *args)` in N fresh interpreters. While the program runs, start_processes is given, instead of
`fn`, a picklable stand-in (`functools.partial(traced, fn, settings)`) that runs `fn` under a Trace in the child
and writes the child's part as rank i (ranks numbered on across spawns, in the order they began) to a folder the
program's process made; that process gathers the parts once its program ends (trace/ranks.py's Job).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from pathlib import Path

LAUNCHER = "torch.multiprocessing.spawn"


class Spawns:
    """While entered, every start_processes of torch.multiprocessing traces its processes; `world` is how many."""

    def __init__(self, apis, max_bytes: int, program: str, expectations: list, tracer=None):
        self.settings = {"apis": tuple(apis), "max_bytes": max_bytes, "program": program, "folder": None,
                         "expect": list(expectations)}
        self.world = 0
        self._tracer = tracer  # whose note of child processes not traced leaves out these, traced
        self._undo: list = []

    @property
    def folder(self) -> Path | None:
        return Path(self.settings["folder"]) if self.settings["folder"] else None

    def __enter__(self) -> Spawns:
        import torch.multiprocessing

        module = sys.modules["torch.multiprocessing.spawn"]
        original = module.start_processes

        def start_processes(fn, args=(), nprocs=1, *rest, **kwargs):
            if self.settings["folder"] is None:
                self.settings["folder"] = tempfile.mkdtemp(prefix="maskcli-spawn-")
            wrapped = functools.partial(traced, fn, {**self.settings, "first": self.world, "world": nprocs})
            self.world += nprocs
            watch = getattr(self._tracer, "threads", None)
            before = len(watch.processes) if watch is not None else 0
            try:
                return original(wrapped, args, nprocs, *rest, **kwargs)
            finally:
                if watch is not None:  # (started by now, join or not)
                    del watch.processes[before:before + nprocs]

        for owner in (module, torch.multiprocessing):  # spawn looks it up in its module; programs in the package
            if getattr(owner, "start_processes", None) is original:
                setattr(owner, "start_processes", start_processes)
                self._undo.append(functools.partial(setattr, owner, "start_processes", original))
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()


def traced(fn, settings: dict, index: int, *args) -> None:
    """A spawned process: `fn(index, *args)` run under a Trace, its part written as rank first + index."""
    from maskcli.trace.capture import Trace
    from maskcli.trace.merged import part
    from maskcli.trace.ranks import Job, ProcessGroups

    job = Job(settings["first"] + index, settings["world"], index, LAUNCHER, Path(settings["folder"]))
    job.begin()
    tracer = Trace(settings["apis"], settings["max_bytes"])
    watched = ProcessGroups(lambda: len(tracer.calls))
    status = 1  # (an exception: spawn sees it raised, as without maskcli)
    try:
        with tracer, watched:
            fn(index, *args)
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        raise
    finally:
        from maskcli.trace.expect import check

        with _held_term():  # (spawn's join stops the others once one process fails: this one's part is written first)
            failures = check(tracer.calls, settings["expect"]) if settings["expect"] else []
            job.write(part(tracer, tracer.groups(), status, settings["program"], failures, tracer.notes(), [], job, watched))


@contextlib.contextmanager
def _held_term():
    """A SIGTERM that comes while a spawned process writes its part (its function has returned or raised) is held
    until the part is written, then delivered as it came: the process ends by it, as it would have, its part kept."""
    import signal

    came = []
    try:
        before = signal.signal(signal.SIGTERM, lambda number, frame: came.append(number))
    except (ValueError, OSError):  # (not the main thread)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
        if came:
            os.kill(os.getpid(), signal.SIGTERM)


def gather(spawns: Spawns, timeout: float):
    """(parts, missing, the Job that gathered them: clean() it when done) of every process the program spawned, once
    each wrote its part or the timeout passed."""
    from maskcli.trace.ranks import Job

    reporter = Job(-1, spawns.world, None, LAUNCHER, spawns.folder)
    reporter.started = min(reporter.started, os.path.getmtime(spawns.folder))
    return (*reporter.gather(timeout), reporter)
