"""How a traced program ends, as under python: its non-daemon threads joined before the report, os._exit(n) still
reported, and the threads left running (daemon threads) stopped where python's exit would stop them.

Python's exit (Py_FinalizeEx) joins the non-daemon threads (threading._shutdown), runs the atexit functions, flushes
the standard streams and then freezes every thread left: a daemon thread never runs Python code again, and one that
is inside C or C++ code (a torch operator) when it comes back for the interpreter is ended there (pthread_exit: an
abort through C++ frames), as is one that holds stdout's lock (a fatal error). trace's report takes seconds; with
those threads running through it, they would print, compute and finish where python had stopped them. So the report
is written by a forked copy of the process (threads are not copied by fork), while this process waits for it holding
the interpreter (its threads stay where the program's end left them) and then exits as python would.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading


def join_threads(before: set) -> None:
    """What python's exit does once the main module is done (threading._shutdown, which this process may outlive: a
    test's, an in-process run's): the executors of the threads the program started (not in `before`) told to stop
    once their queued work is done, as concurrent.futures' exit functions tell them, then each of those threads that
    is not a daemon joined. The calls they make in the meantime are the program's."""
    while True:
        started = [thread for thread in threading.enumerate() if thread not in before and thread.is_alive()
                   and not thread.daemon and thread is not threading.current_thread()
                   and not isinstance(thread, threading._DummyThread)]
        if not started:
            return
        for thread in started:
            _stop_executor(thread)
        for thread in started:
            thread.join()


def _stop_executor(thread: threading.Thread) -> None:
    """A worker or manager thread of a concurrent.futures executor: its executor shut down without waiting (the work
    queued still runs), as python's exit does for them all."""
    modules = [sys.modules.get(name) for name in ("concurrent.futures.thread", "concurrent.futures.process")]
    if not any(module is not None and thread in getattr(module, table, {})
               for module, table in zip(modules, ("_threads_queues", "_threads_wakeups"))):
        return
    owner = getattr(thread, "executor_reference", None) or next(iter(getattr(thread, "_args", ()) or ()), None)
    executor = owner() if callable(owner) else None
    shutdown = getattr(executor, "shutdown", None)
    if shutdown is not None:
        with contextlib.suppress(Exception):
            shutdown(wait=False)


def others() -> list[threading.Thread]:
    """The threads still running besides this one (daemon threads, after join_threads)."""
    current = threading.current_thread()
    return [thread for thread in threading.enumerate() if thread is not current and thread.is_alive()]


def alone(report, reset=(), then=None) -> int:
    """report()'s exit status, computed where no other thread of the program runs: in a forked copy of this process
    when others() are running, else here. This process waits for the copy holding the interpreter, so those threads
    stay where they were, and then (given `then`) ends by then(status) before letting it go (see finish()).
    `reset`: objects whose `_lock` a thread of the program may hold at the fork (the copy gets fresh ones)."""
    if not others() or not hasattr(os, "fork"):
        return report()
    import warnings

    wait = _waiter()  # (made now: importing ctypes after the fork would let the interpreter go)
    _hold_streams()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e6)  # (a thread waiting for the interpreter does not ask this one to let it go)
    with warnings.catch_warnings():  # (3.12: "this process is multi-threaded": its copy runs one thread, by design)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            pid = os.fork()
        except OSError:
            sys.setswitchinterval(interval)
            return report()
    if pid:
        code = wait(pid)
        if then is not None:
            then(code)
        sys.setswitchinterval(interval)
        return code
    code = 1
    try:
        for owner in reset:  # held, maybe, by a thread that is not in this copy
            owner._lock = threading.RLock()
        torch = sys.modules.get("torch")
        if torch is not None:  # OpenMP's threads are not in this copy either: a parallel operator would wait for them
            torch.set_num_threads(1)  # forever (torch's own advice for a forked worker)
        sys.setswitchinterval(interval)
        sys.stdout = None  # the program's unflushed output is written once, by the process python's exit flushes
        with contextlib.suppress(Exception):
            sys.stderr = open(os.dup(sys.stderr.fileno()), "w", encoding="utf-8", errors="replace")  # noqa: SIM115
        code = report()
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


def _hold_streams() -> None:
    """sys.stdout and sys.stderr made to stop the threads left running at their next write (they wait there for the
    process to end, holding no lock of the stream), and then flushed here, a few times with a pause between, which
    waits for a thread writing now to be done with the write it is in (a print makes two). A thread that prints in a
    loop spends its time without the interpreter inside the write that holds the stream's lock, and that is where it
    hands the interpreter over: held from then on through the report (alone()), it would still hold the lock at the
    flush of python's exit, which then aborts ("_enter_buffered_busy") where python mostly exits 0 (python's own exit
    takes the interpreter from it once, at the end, not after a wait)."""
    import time

    me, held = threading.get_ident(), []
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Held):
            setattr(sys, name, _Held(stream, me))
            held.append(stream)
    for _ in range(3) if held else ():
        for stream in held:
            with contextlib.suppress(Exception):
                stream.flush()
        time.sleep(0.005)  # (a thread that waited for the lock or the interpreter ends its print and stops at the next)


class _Held:
    """A standard stream that only the thread `owner` writes through; any other thread that writes or flushes it waits
    there until the process ends (python's exit would have stopped it by then)."""

    _never = threading.Event()

    def __init__(self, stream, owner: int):
        self._stream, self._owner = stream, owner

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def _mine(self) -> None:
        if threading.get_ident() != self._owner:
            while True:
                self._never.wait()

    def write(self, text):
        self._mine()
        return self._stream.write(text)

    def writelines(self, lines):
        self._mine()
        return self._stream.writelines(lines)

    def flush(self):
        self._mine()
        return self._stream.flush()


def finish(code: int) -> None:
    """End this process with `code` as python's exit would have ended the program: Py_Exit, called without letting
    the interpreter go, runs the atexit functions, marks the interpreter finalizing and flushes the standard streams,
    and every thread that comes back for the interpreter after that ends there (an abort through a C++ caller's
    frames, as under python, where such a thread is in the middle of a torch operator when the program ends)."""
    import ctypes

    for name in ("stdout", "stderr"):  # (the first open one: its flush, after the mark, wakes the waiting threads)
        stream = getattr(sys, name)
        if stream is not None and not getattr(stream, "closed", True):
            setattr(sys, name, _Waking(stream))
            break
    ctypes.pythonapi.Py_Exit(ctypes.c_int(code))


class _Waking:
    """A standard stream whose flush, the one python's exit makes once the interpreter is marked finalizing, lets it
    go a moment: the threads waiting for it (here since the program ended) take it and are ended, as python's are."""

    def __init__(self, stream):
        import time

        self._stream, self._sleep = stream, time.sleep

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def flush(self):
        try:
            return self._stream.flush()
        finally:
            self._sleep(0.1)  # (long enough for a loaded machine to run them)


def _waiter():
    """wait(pid): the child's exit status, waited for without letting the interpreter go: ctypes' PyDLL keeps it while
    waitpid blocks, so no thread of the program runs Python meanwhile (those in C code carry on, and wait for it after)."""
    import ctypes
    import errno

    waitpid = ctypes.PyDLL(None, use_errno=True).waitpid
    status = ctypes.c_int()
    pointer = ctypes.byref(status)

    def wait(pid: int) -> int:
        while True:
            try:
                if waitpid(pid, pointer, 0) != -1:
                    break
                if ctypes.get_errno() != errno.EINTR:
                    return 1
            except BaseException:  # noqa: BLE001 - Ctrl-C or SIGTERM reach the child too, which ends the report its way
                continue
        code = os.waitstatus_to_exitcode(status.value)
        return code if code >= 0 else 128 - code  # (killed by a signal: the shell's way of saying it)

    return wait


class Exits:
    """While entered, os._exit(n) called by the program in this process calls `report(n)`, which writes trace's report
    and returns the exit status, and then ends the process with it, as os._exit does: no finally block, no atexit
    function, no flush of the program's streams. A forked child's os._exit (multiprocessing's) is left alone."""

    def __init__(self, report):
        self.report = report
        self.pid = os.getpid()
        self.ending = False

    def __enter__(self) -> Exits:
        self.real = os._exit
        real, watch = self.real, self

        def _exit(status, /):
            if os.getpid() != watch.pid or watch.ending or not isinstance(status, int) or not -2**31 <= status < 2**31:
                real(status)  # (a wrong type or size raises there, as it would)
            watch.ending = True
            code = status
            try:
                code = watch.report(int(status))  # (True is 1)
            finally:
                real(code)

        os._exit = _exit
        return self

    def __exit__(self, *exc) -> None:
        if getattr(os, "_exit", None) is not self.real:
            os._exit = self.real
