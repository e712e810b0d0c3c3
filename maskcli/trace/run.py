"""Running the user's program in this process, as `python SCRIPT` or `python -m MODULE` would (and as
`coverage run` does): its own sys.argv, `__main__`, sys.path[0] and exit status, its traceback as Python prints it."""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback

from maskcli.errors import MaskError


def check_program(script: str | None, module: str | None) -> None:
    """Refuse what cannot run before anything is traced."""
    if (script is None) == (module is None):
        raise MaskError("give the program to trace: maskcli trace SCRIPT.py [ARGS]... or maskcli trace -m MODULE [ARGS]...")
    if script is not None and not os.path.isfile(script):
        raise MaskError(f"no such script {script!r}: give the path of a Python file (or -m MODULE for a module)")
    if module is not None:
        import importlib.util

        sys.path.insert(0, os.getcwd())  # as python -m looks: the current folder first
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError) as error:
            found, why = None, str(error)
        else:
            why = "not found on sys.path"
        finally:
            sys.path.pop(0)
        if found is None:
            raise MaskError(f"-m {module!r}: no such module ({why}); run maskcli where python -m {module} runs")


def run_program(script: str | None, module: str | None, args: list[str]) -> int:
    """The program's exit status: 0, its sys.exit code, or 1 after an exception (its traceback on stderr)."""
    saved_argv, saved_path, saved_folder = sys.argv[:], sys.path[:], os.getcwd()
    try:
        if module is not None:
            sys.argv = [module, *args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as stop:
        code = stop.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)  # sys.exit("message") prints it and exits 1, as Python does
        return 1
    except KeyboardInterrupt:
        _print_traceback()
        return 130
    except BaseException:  # noqa: BLE001 - the program's own error: Python would print it and exit 1
        _print_traceback()
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        with contextlib.suppress(OSError):  # the program may have moved (os.chdir): maskcli's own work is where it began
            os.chdir(saved_folder)
        sys.stdout.flush()


def _print_traceback() -> None:
    """The traceback from the program's first frame on, as Python prints it (no frames of maskcli or runpy)."""
    kind, error, tb = sys.exc_info()
    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    while tb is not None and (os.path.abspath(tb.tb_frame.f_code.co_filename) in skip or tb.tb_frame.f_code.co_filename == "<frozen runpy>"):
        tb = tb.tb_next
    traceback.print_exception(kind, error, tb, file=sys.stderr)
