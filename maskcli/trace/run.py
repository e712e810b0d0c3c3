"""Running the user's program in this process, as `python SCRIPT` or `python -m MODULE` would (and as
`coverage run` does): its own sys.argv, `__main__` (with the `__file__`, `__loader__` and `__spec__` python gives it),
sys.path[0] and exit status, its traceback as Python prints it. What it changes of the interpreter that maskcli's
report needs after it (sys.stdout and sys.stderr, the recursion limit, the builtins, the signal handlers) is put back
when it ends, so the report is written as it would be without the program."""

from __future__ import annotations

import builtins
import contextlib
import os
import runpy
import signal
import sys
import traceback
import types
import warnings

from maskcli.errors import MaskError

_dict, _vars, _setattr = dict, vars, setattr  # the real ones, whatever the program does to the builtins module
HERE = os.path.dirname(os.path.abspath(__file__))  # maskcli/trace: the recording wrappers the program's calls pass through


def check_program(script: str | None, module: str | None) -> None:
    """Refuse what cannot run before anything is traced."""
    if (script is None) == (module is None):
        raise MaskError("give the program to trace: maskcli trace SCRIPT.py [ARGS]... or maskcli trace -m MODULE [ARGS]...")
    if script is not None and script.startswith("-") and not os.path.isfile(script):  # an option trace does not have
        raise MaskError(f"no such option: {script} (maskcli trace --help lists trace's own; they come before the program)")
    if script is not None and not os.path.isfile(script):
        what = ("is a directory" if os.path.isdir(script) else "is not a regular file") if os.path.exists(script) else ""
        raise MaskError(f"{f'{script!r} {what}' if what else f'no such script {script!r}'}: give the path of a Python file "
                        "(or -m MODULE for a module)")
    if module is not None:
        import importlib.util

        sys.path.insert(0, os.getcwd())  # as python -m looks: the current folder first
        try:
            found = importlib.util.find_spec(module)  # (imports the packages above it, as python -m does)
        except (ImportError, ValueError) as error:
            found, why = None, str(error)
        else:
            why = "not found on sys.path"
        finally:
            sys.path.pop(0)
        if found is None:
            raise MaskError(f"-m {module!r}: no such module ({why}); run maskcli where python -m {module} runs")


class World:
    """While entered: the signal handlers the process had before maskcli set its own (the program's, as under python:
    SIGHUP ignored under nohup, SIGTERM's default kills it). On exit, whatever the program did to them, to sys.stdout,
    sys.stderr, the recursion limit and the builtins is undone for maskcli's report (its stdout and stderr are
    flushed first: what it wrote reaches where it sent it)."""

    def __init__(self, handlers: dict | None = None):
        self.handlers = handlers or {}  # signal number -> the handler before maskcli's (commands.main keeps them)
        self.flush = True  # False where the program ends by os._exit, which flushes nothing
        self.unflushed = False  # a flush of the program's stdout or stderr raised: python then exits 120

    def __enter__(self) -> World:
        self.streams = (sys.stdout, sys.stderr)
        self.limit = sys.getrecursionlimit()
        self.builtins = dict(vars(builtins))
        self.ours = {number: signal.getsignal(number) for number in self.handlers}
        for number, handler in self.handlers.items():
            _set_signal(number, handler)
        self.pid = os.getpid()
        return self

    def __exit__(self, *exc) -> None:
        if self.flush:  # python flushes them at exit: the program's own, wherever they go
            self.unflushed = _flush_as_python(sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = self.streams
        sys.setrecursionlimit(max(self.limit, sys.getrecursionlimit()))
        for name, value in self.builtins.items():
            if vars(builtins).get(name) is not value:
                setattr(builtins, name, value)  # (names the program added are left: its atexit code may use them)
        for number, handler in self.ours.items():
            _set_signal(number, handler)

    def forked(self) -> bool:
        """This process is a child the program forked that returned from its code (its parent reports the trace)."""
        return os.getpid() != self.pid


def _flush_as_python(stdout, stderr) -> bool:
    """Flush the program's streams as python's exit does (pylifecycle.c flush_std_files): stdout's error printed as an
    unraisable one ("Exception ignored in: ..."), stderr's dropped; True where either raised (python exits 120)."""
    failed = False
    for stream, said in ((stdout, True), (stderr, False)):
        if stream is None or _closed(stream):
            continue
        try:
            stream.flush()
        except Exception as error:  # noqa: BLE001 - the program's stream: whatever it raises is python's to report
            failed = True
            if said:
                with contextlib.suppress(Exception):
                    _unraisable(error, stream)
    return failed


def _unraisable(error: BaseException, stream) -> None:
    """PyErr_WriteUnraisable's lines for `error` raised by `stream`.flush() (the program's sys.unraisablehook where it set
    one; python's default prints the stream and the traceback from the stream's own frame)."""
    tb = error.__traceback__.tb_next if error.__traceback__ is not None else None  # (this module's frame left out)
    if sys.unraisablehook is not sys.__unraisablehook__:
        sys.unraisablehook(types.SimpleNamespace(exc_type=type(error), exc_value=error, exc_traceback=tb, err_msg=None,
                                                 object=stream))
        return
    out = sys.stderr
    if out is None:
        return
    try:
        shown = repr(stream)
    except Exception:  # noqa: BLE001 - the program's object
        shown = "<object repr() failed>"
    out.write(f"Exception ignored in: {shown}\n")
    traceback.print_exception(type(error), error, tb, file=out)
    out.flush()


def _closed(stream) -> bool:
    """A true `closed` (python's file_is_closed: one that raises reads as open)."""
    try:
        return bool(stream.closed)
    except Exception:  # noqa: BLE001 - the program's object
        return False


def _set_signal(number: int, handler) -> None:
    with contextlib.suppress(ValueError, OSError, TypeError):  # (not the main thread; None: set outside Python)
        if handler is not None:
            signal.signal(number, handler)


interrupted = False  # the program ended by a KeyboardInterrupt it did not catch


def run_program(script: str | None, module: str | None, args: list[str]) -> int:
    """The program's exit status: 0, its sys.exit code, or 1 after an exception (its traceback on stderr)."""
    saved_argv, saved_path, saved_folder, saved_hook = sys.argv[:], sys.path[:], os.getcwd(), sys.excepthook
    modules = dict(sys.modules)  # what the trace's own exit and report import (sys.modules.clear() left a new `sys`)
    saved_show = warnings.showwarning
    warnings.showwarning = _as_the_programs(saved_show)
    limits = sys.setrecursionlimit, sys.getrecursionlimit, sys.getrecursionlimit()
    _limit_from_the_programs_frame()
    ours = dict(vars(builtins))
    import json
    import tempfile

    import numpy
    import torch

    tools = {tool: dict(vars(tool)) for tool in (os, os.path, traceback, contextlib, runpy, json, tempfile, numpy, torch)}
    tools[sys] = {name: value for name, value in vars(sys).items()  # what maskcli's code after the program calls (not
                  if callable(value) and not name.endswith("hook")}  # the hooks: the program's excepthook runs as python's)
    try:
        try:
            _forget_main()
            _drop_launchers_folder(saved_argv)
            if module is not None:
                sys.argv = [module, *args]
                sys.path.insert(0, os.getcwd())
                runpy.run_module(module, run_name="__main__", alter_sys=True,
                                 init_globals={"__builtins__": builtins, "__annotations__": {}})
            else:
                sys.argv = [script, *args]
                _run_script(script)
        finally:  # python reads its exit and prints its traceback in C, whatever the program made of int, len or id
            theirs = _put_back(ours)
            for tool, values in tools.items():  # (os.chdir, sys.exc_info, traceback.print_exception, json.dump,
                _put_back(values, tool)  # tempfile.mkstemp the program replaced: python's own ending calls none)
        return 0
    except SystemExit as stop:
        code = stop.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        _say_exit(code)  # sys.exit("message") prints it and exits 1, as Python does
        return 1
    except KeyboardInterrupt:
        _print_traceback(theirs, saved_hook)
        global interrupted
        interrupted = True  # python then ends by SIGINT, not exit(130): commands.main does the same after the report
        return 130
    except BaseException:  # noqa: BLE001 - the program's own error: Python would print it and exit 1
        _print_traceback(theirs, saved_hook)
        return 1
    finally:
        programs = sys.getrecursionlimit()  # (the limit the program set, counted from its own first frame)
        sys.setrecursionlimit, sys.getrecursionlimit = limits[:2]
        sys.setrecursionlimit(max(limits[2], programs))  # (not the raised one: each traced run would raise it again)
        if getattr(warnings.showwarning, "__wrapped__", None) is saved_show:  # (one the program set stays its own)
            warnings.showwarning = saved_show
        sys.argv, sys.path = saved_argv, sys.path if isinstance(sys.path, list) else []  # (sys.path = None)
        sys.path[:] = saved_path
        sys.excepthook = saved_hook  # a hook the program set (torch.distributed's "[rank0]:" prefix) ends with it
        for name, module in modules.items():  # a program that del sys.modules["torch"]: importing torch again would
            if sys.modules.get(name) is None:  # register its operators twice (RuntimeError) in the trace's report;
                sys.modules[name] = module  # (one the program set to None: "import of numpy halted"; sys.modules
                # cleared: `import warnings` made a `sys` of its own, with no warnoptions)
        with contextlib.suppress(OSError):  # the program may have moved (os.chdir): maskcli's own work is where it began
            os.chdir(saved_folder)


def _put_back(values: dict, module=builtins) -> dict:
    """What the builtins module (or `module`) holds, after `values` are put back in it (names the program added stay:
    its atexit code and its threads may use them). Reads and writes it with functions bound when maskcli imported
    this module."""
    held = _dict(_vars(module))
    for name, value in values.items():
        if held.get(name) is not value:
            _setattr(module, name, value)
    return held


def _say_exit(code) -> None:
    """sys.exit(CODE) that is no int, as Python ends it (pythonrun.c handle_system_exit): str(CODE) on sys.stderr, or on
    fd 2 where the program set it to None, dropped where its str raises or the stream fails; then a newline, on fd 2
    where sys.stderr cannot take it (PySys_WriteStderr). Never the trace's error: the status is 1 whatever happens."""
    with contextlib.suppress(Exception, SystemExit):  # the program's object or stream: Python drops the error too
        if sys.stderr is None:
            os.write(2, str(code).encode("utf-8", "backslashreplace"))
        else:
            sys.stderr.write(str(code))
    try:
        sys.stderr.write("\n")
    except (Exception, SystemExit):  # noqa: BLE001 - None, closed, or a writer that raises
        with contextlib.suppress(OSError):
            os.write(2, b"\n")


def _limit_from_the_programs_frame(headroom: int = 100) -> None:
    """The recursion limit counted from the program's first frame, as under python: the frames below it (maskcli's
    command, Typer's, this runner's) and `headroom` for the wrappers an attention call passes through are added to the
    limit the program sets and taken from the one it reads (a program that sets a limit of 20 runs, as under python)."""
    import operator

    frame, below = sys._getframe(), 0
    while frame is not None:
        frame, below = frame.f_back, below + 1
    below += headroom
    real_set, real_get = sys.setrecursionlimit, sys.getrecursionlimit

    top = 2**31 - 1  # python's largest (a C int): a program may set it, and read it back
    asked = [None]

    def setrecursionlimit(limit, /):
        limit = operator.index(limit)
        if limit < 1:
            raise ValueError("recursion limit must be greater or equal than 1")
        real_set(limit if limit > top else min(limit + below, top))  # (past top: python's OverflowError)
        asked[0] = limit

    def getrecursionlimit():
        return asked[0] if real_get() == top and asked[0] is not None else real_get() - below

    real_set(real_get() + below)
    sys.setrecursionlimit, sys.getrecursionlimit = setrecursionlimit, getrecursionlimit


def _as_the_programs(show):
    """warnings.showwarning that puts a warning torch raised inside a call the trace followed (a tensor's __float__ run
    by the trace's mode: its innermost Python frame is maskcli's) at the program's line, as python shows it."""
    import functools

    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    skip = (own + os.sep, os.path.dirname(os.path.abspath(__import__("torch").__file__)) + os.sep,
            os.path.abspath(warnings.__file__))

    @functools.wraps(show)
    def showwarning(message, category, filename, lineno, file=None, line=None):
        if str(filename).startswith(skip[0]):
            frame = sys._getframe(1)
            while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
                frame = frame.f_back
            if frame is not None:
                filename, lineno, line = frame.f_code.co_filename, frame.f_lineno, None
        return show(message, category, filename, lineno, file, line)

    return showwarning


def _forget_main() -> None:
    """Dynamo imports `__main__` once per process (functools.cache) and keeps it as `__import___main__` in the globals
    of the frame it compiled (flex_attention's eager path compiles its mask_mod so): a second program run in this
    process would have its mask_mod's globals read from the first one's module. Where an earlier program left that
    alias, drop it, the cache and dynamo's compiled code, as a fresh `python` would start."""
    convert = sys.modules.get("torch._dynamo.symbolic_convert")
    if convert is None:
        return
    held = [space for space in (getattr(module, "__dict__", None) for module in list(sys.modules.values()))
            if isinstance(space, dict) and isinstance(space.get("__import___main__"), types.ModuleType)]
    convert._import_module.cache_clear()
    if held:
        import torch._dynamo

        for space in held:
            del space["__import___main__"]
        torch._dynamo.reset()


def _drop_launchers_folder(argv: list) -> None:
    """Take out of sys.path the folder Python put first for maskcli's own launch (the console script's bin folder, or
    the current folder of `python -m maskcli`), which `python SCRIPT` would not have: a program run from a folder of
    stray modules would import them where python imports the library's (a `/tmp/a.py`). Left where Python put none
    (-P, PYTHONSAFEPATH) or something else stands first (a test runner's folder)."""
    if sys.flags.safe_path or not sys.path or not argv:
        return
    launcher = str(argv[0])
    if launcher.endswith(os.path.join("maskcli", "__main__.py")):
        own = (os.getcwd(), "")
    else:
        own = (os.path.dirname(os.path.realpath(launcher)), os.path.dirname(os.path.abspath(launcher)))
    if sys.path[0] in own:
        del sys.path[0]


def _run_script(script: str) -> None:
    """`python SCRIPT`: __file__ absolute as given (not normalised), a SourceFileLoader named __main__, no __spec__,
    the builtins module as __builtins__, an empty __annotations__; sys.path[0] the script's folder with links resolved
    (Python/pathconfig.c _PyPathConfig_ComputeSysPath0); the code compiled under its absolute name, as its
    tracebacks show it. It runs in a module of its own put in sys.modules['__main__'] while it runs (runpy's way)."""
    import importlib.machinery
    import importlib.util
    import io
    import marshal

    path = script if os.path.isabs(script) else os.path.join(os.getcwd(), script)
    with io.open_code(path) as file:
        data = file.read()
    if data[:4] == importlib.util.MAGIC_NUMBER:  # a compiled .pyc, which python runs too
        code, loader = marshal.loads(data[16:]), importlib.machinery.SourcelessFileLoader("__main__", path)
    else:
        code, loader = compile(data, path, "exec", dont_inherit=True), importlib.machinery.SourceFileLoader("__main__", path)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __loader__=loader, __spec__=None, __package__=None,
                         __builtins__=builtins, __annotations__={})  # (python's __main__ holds an empty __annotations__)
    sys.path.insert(0, os.path.dirname(os.path.realpath(path)))
    before = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if sys.modules.get("__main__") is main and before is not None:
            sys.modules["__main__"] = before


def _ours(tb) -> bool:
    """A frame of maskcli's recording wrappers, this runner or runpy: not the program's, so not in its traceback."""
    name = tb.tb_frame.f_code.co_filename
    return name.startswith(("<frozen runpy>",)) or os.path.dirname(os.path.abspath(name)) == HERE or \
        os.path.abspath(name) == os.path.abspath(runpy.__file__)


def _print_traceback(theirs: dict, before) -> None:
    """The traceback as Python prints it: the program's frames and the libraries', none of maskcli's (its wrappers sit
    between the program's call and torch's function) nor runpy's, in the error and in those chained to it; the
    program's own sys.excepthook (not the one it began with: Typer's) called with the builtins it left (`theirs`)."""
    kind, error, tb = sys.exc_info()
    seen = set()
    chained = error
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        chained.__traceback__ = _without_ours(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__
    hook = sys.excepthook
    if hook not in (sys.__excepthook__, None, before):  # the program's own hook, which python calls instead
        ours = _put_back(theirs)
        try:
            hook(kind, error, error.__traceback__)
            return
        except BaseException as failed:  # noqa: BLE001 - python's words for a hook that raises, then the error itself
            _put_back(ours)
            print("Error in sys.excepthook:", file=sys.stderr)
            traceback.print_exception(type(failed), failed, _without_ours(failed.__traceback__), file=sys.stderr, chain=False)
            print("\nOriginal exception was:", file=sys.stderr)
        finally:
            _put_back(ours)
    traceback.print_exception(kind, error, error.__traceback__, file=sys.stderr)


def _without_ours(tb):
    """The traceback with maskcli's frames unlinked (tb_next is writable: Python 3.7)."""
    kept = []
    while tb is not None:
        if not _ours(tb):
            kept.append(tb)
        tb = tb.tb_next
    for here, after in zip(kept, kept[1:] + [None]):
        here.tb_next = after
    return kept[0] if kept else None
