"""maskcli.trace.run: a program traced runs in the world python gives it, each one run both ways in a process of
its own and compared with python's own run (stdout, exit status, stderr up to trace's report)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPORT = "maskcli trace "


def run_both(folder: Path, target: list[str], trace_options=(), ignore_hup: bool = False, buffered: bool = False):
    """(python's run, trace's run) of `target` (a script and its arguments, or -m MODULE) from `folder`; `buffered`:
    stdout block-buffered as python keeps it for a file or a pipe (PYTHONUNBUFFERED unset)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    env.pop("TORCHDYNAMO_DISABLE", None)
    if buffered:
        env.pop("PYTHONUNBUFFERED", None)
    options = {"cwd": folder, "env": env, "capture_output": True, "text": True, "timeout": 300}
    if ignore_hup:  # as nohup starts a program
        options["preexec_fn"] = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)
    plain = subprocess.run([sys.executable, *target], **options)
    traced = subprocess.run([sys.executable, "-m", "maskcli", "trace", *trace_options, *target], **options)
    return plain, traced


def write(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


WORLD = """
    import sys
    import types
    print(__file__, type(__loader__).__name__, __loader__.name, __loader__.path, __spec__ and __spec__.name)
    print(sys.argv, sys.path[0], __name__, __package__, __cached__, isinstance(__builtins__, types.ModuleType))
    print(sys.modules["__main__"].__dict__ is globals(), __doc__)
    def inner():
        raise ValueError("the program's own error")
    inner()
"""


def test_a_script_gets_pythons_file_loader_argv_and_path_and_its_traceback_as_python_prints_it(tmp_path):
    """python makes __file__ absolute (not normalised), gives a SourceFileLoader, sys.path[0] the script's real
    folder (its link resolved); runpy.run_path gave the relative name and no loader."""
    write(tmp_path / "real" / "prog.py", WORLD)
    (tmp_path / "here").mkdir()
    os.symlink(tmp_path / "real" / "prog.py", tmp_path / "here" / "link.py")
    plain, traced = run_both(tmp_path / "here", ["../here/link.py", "a b", "--x"])
    assert plain.returncode == traced.returncode == 1
    assert f"{tmp_path}/here/../here/link.py SourceFileLoader __main__" in plain.stdout  # (what python gives, here)
    assert traced.stdout == plain.stdout
    assert traced.stderr.startswith(plain.stderr) and REPORT + "link.py: 0 attention calls" in traced.stderr


def test_a_module_gets_pythons_spec_and_loader_and_its_package_is_not_imported_twice(tmp_path):
    write(tmp_path / "pkg" / "__init__.py", "print('package imported')\n")
    write(tmp_path / "pkg" / "mod.py", WORLD)
    plain, traced = run_both(tmp_path, ["-m", "pkg.mod", "arg"])
    assert plain.returncode == traced.returncode == 1
    assert traced.stdout == plain.stdout and plain.stdout.count("package imported") == 1
    runpys = '  File "<frozen runpy>", line 198, in _run_module_as_main\n  File "<frozen runpy>", line 88, in _run_code\n'
    assert runpys in plain.stderr  # python -m's own runner, which trace's stands in for: the program's frames follow
    assert traced.stderr.startswith(plain.stderr.replace(runpys, ""))


def test_maskcli_frames_are_not_in_the_programs_traceback(tmp_path):
    """An error raised by the attention function the trace wraps: python shows the program's frames (SDPA is C), not
    the mode's __torch_function__ between them; chained errors too."""
    write(tmp_path / "prog.py", """
        import torch
        import torch.nn.functional as F
        def attend():
            x = torch.randn(1, 1, 4, 8)
            return F.scaled_dot_product_attention(x, x, x, attn_mask=torch.ones(3, 3, dtype=torch.bool))
        try:
            attend()
        except RuntimeError as error:
            raise ValueError("wrapped") from error
    """)
    plain, traced = run_both(tmp_path, ["prog.py"])
    assert plain.returncode == traced.returncode == 1
    assert traced.stderr.startswith(plain.stderr)  # (and so no frame of maskcli's capture.py between them)
    assert plain.stderr.count('  File "') == 3


def test_a_program_that_closes_and_replaces_its_streams_lowers_the_recursion_limit_and_replaces_open(tmp_path):
    """Its output and exit status are python's; the report and --json are still written (they use the streams, the
    limit and the open that maskcli started with)."""
    write(tmp_path / "prog.py", """
        import builtins, io, signal, sys
        import torch
        import torch.nn.functional as F
        x = torch.randn(1, 1, 4, 8)
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
        signal.signal(signal.SIGTERM, lambda *a: print("handled SIGTERM"))
        signal.raise_signal(signal.SIGTERM)
        sys.setrecursionlimit(60)
        def refuse(*args, **kwargs):
            raise PermissionError("no files")
        builtins.open = refuse
        print("written")
        sys.stdout.flush()
        sys.stdout.close()
        sys.stderr.close()
        sys.stdout = sys.stderr = io.StringIO()
        print("not shown")
    """)
    plain, traced = run_both(tmp_path, ["prog.py"], ["--json", "out.json"])
    assert plain.returncode == traced.returncode == 0
    assert traced.stdout == plain.stdout == "handled SIGTERM\nwritten\n" and plain.stderr == ""
    assert traced.stderr.startswith(REPORT + "prog.py: 1 attention call in 1 group")
    assert '"exit_status": 0' in (tmp_path / "out.json").read_text()


def test_the_recursion_limit_counts_from_the_programs_first_frame(tmp_path):
    """A limit of 20 set before an attention call, the limit read back, and a recursion to 990 frames but not to
    1,200: as under python (maskcli's own frames below the program and inside its wrappers are not the program's)."""
    write(tmp_path / "prog.py", """
        import sys
        import torch
        import torch.nn.functional as F
        def depth(n):
            return 0 if n == 0 else 1 + depth(n - 1)
        print(sys.getrecursionlimit(), depth(990))
        try:
            depth(1200)
        except RecursionError:
            print("too deep")
        try:
            sys.setrecursionlimit(0)
        except ValueError as error:
            print(error)
        sys.setrecursionlimit(20)
        print(sys.getrecursionlimit())
        x = torch.randn(1, 1, 4, 8)
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
        print("ran")
    """)
    plain, traced = run_both(tmp_path, ["prog.py"], [])
    assert plain.returncode == traced.returncode == 0
    assert traced.stdout == plain.stdout == "1000 990\ntoo deep\nrecursion limit must be greater or equal than 1\n20\nran\n"
    assert traced.stderr.startswith(REPORT + "prog.py: 1 attention call in 1 group")


def test_a_trace_in_process_leaves_the_recursion_limit_as_it_found_it(tmp_path):
    """The limit raised by the frames below the program is taken back when it ends (each run raised it again: a later
    deep JSON parse in the same process overflowed the C stack), while a limit the program raised stays, as before."""
    from typer.testing import CliRunner

    from maskcli.commands import app

    write(tmp_path / "prog.py", "import sys\nprint(sys.getrecursionlimit())\n")
    before = sys.getrecursionlimit()
    for _ in range(3):
        assert CliRunner().invoke(app, ["trace", str(tmp_path / "prog.py")]).stdout.startswith(f"{before}\n")
    assert sys.getrecursionlimit() == before


FLEX_WITH_A_GLOBAL = """\
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention, create_block_mask
    {name} = {width}
    def window(b, h, q, k):
        return (q >= k) & (q - k < {name})
    q = torch.randn(1, 1, 8, 16)
    block = create_block_mask(window, None, None, 8, 8, device="cpu", _compile=False)
    allowed = torch.tensor([[0 <= i - j < {width} for j in range(8)] for i in range(8)])
    ok = torch.allclose(flex_attention(q, q, q, block_mask=block), F.scaled_dot_product_attention(q, q, q, allowed), atol=1e-5)
    print("same" if ok else "different")
"""


def test_programs_traced_one_after_another_in_a_process_each_read_their_own_globals(tmp_path):
    """flex_attention's eager path compiles the mask_mod, and dynamo imports `__main__` once per process: the second
    program's mask_mod read its window from the first program's module (AttributeError, or the first one's value)."""
    from typer.testing import CliRunner

    from maskcli.commands import app

    for n, (name, width) in enumerate((("W", 2), ("FIXED", 3), ("W", 5))):
        write(tmp_path / f"prog{n}.py", FLEX_WITH_A_GLOBAL.format(name=name, width=width))
        result = CliRunner().invoke(app, ["trace", str(tmp_path / f"prog{n}.py")])
        assert (result.exit_code, result.stdout.splitlines()[0]) == (0, "same"), result.output


def test_a_forked_child_that_returns_from_the_program_prints_no_report(tmp_path):
    write(tmp_path / "prog.py", """
        import os
        pid = os.fork()
        if pid == 0:
            print("child", flush=True)
        else:
            os.waitpid(pid, 0)
            print("parent")
    """)
    plain, traced = run_both(tmp_path, ["prog.py"])
    assert traced.stdout == plain.stdout == "child\nparent\n"
    assert plain.returncode == traced.returncode == 0
    assert traced.stderr.count(REPORT) == 1 and "os.fork()" in traced.stderr


def test_the_program_gets_the_signal_handlers_python_gives_it_under_nohup(tmp_path):
    """SIGHUP ignored (nohup) stays ignored, so the program lives on; SIGTERM's default ends it as it ends python
    (killed: no report follows, as no line of the program would)."""
    write(tmp_path / "prog.py", """
        import os, signal
        print(signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGTERM), flush=True)
        os.kill(os.getpid(), signal.SIGHUP)
        print("alive", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        print("not reached")
    """)
    plain, traced = run_both(tmp_path, ["prog.py"], ignore_hup=True)
    assert plain.stdout == "1 0\nalive\n" and traced.stdout == plain.stdout
    assert plain.returncode == traced.returncode == -signal.SIGTERM
    assert REPORT not in traced.stderr


@pytest.mark.parametrize("bad", [["--expect", "x=bogus("], ["--save", "/proc/maskcli-t.pt"], ["--api", "nope"]])
def test_every_option_is_checked_before_the_package_of_a_module_is_imported(tmp_path, bad):
    """-m pkg.mod imports pkg (as python -m does): a bad option is refused before that, and before a folder that
    takes no file (/proc passes os.access) is found out after the program ran."""
    if bad[0] == "--save" and not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    write(tmp_path / "pkg" / "__init__.py", "open('imported', 'w').close()\n")
    write(tmp_path / "pkg" / "mod.py", "print('ran')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "maskcli", "trace", *bad, "-m", "pkg.mod"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == "" and not (tmp_path / "imported").exists()
    assert done.stderr.startswith(f"maskcli: error: {bad[0]} ") and done.stderr.count("\n") == 1


def test_exit_statuses_descriptors_and_empty_batches_are_pythons(tmp_path):
    """Hunt 5: a program that closes descriptor 2 (trace exited 2 writing its report there), raises KeyboardInterrupt
    (python ends by SIGINT, trace exited 130), exits 300 (the report said 300, the shell sees 44), or attends over a
    batch of 0 rows (an internal error)."""
    write(tmp_path / "fd2.py", """
        import os
        import torch
        import torch.nn.functional as F
        x = torch.randn(1, 1, 4, 8)
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
        print("closing")
        os.close(2)
    """)
    plain, traced = run_both(tmp_path, ["fd2.py"])
    assert plain.returncode == traced.returncode == 0 and traced.stdout == plain.stdout == "closing\n"
    assert traced.stderr.startswith(REPORT + "fd2.py: 1 attention call in 1 group")
    write(tmp_path / "interrupt.py", "print('before')\nraise KeyboardInterrupt\n")
    plain, traced = run_both(tmp_path, ["interrupt.py"])
    assert plain.returncode == traced.returncode == -signal.SIGINT and traced.stdout == plain.stdout == "before\n"
    write(tmp_path / "status.py", "raise SystemExit(300)\n")
    plain, traced = run_both(tmp_path, ["status.py"])
    assert plain.returncode == traced.returncode == 300 % 256
    assert "the program exited with status 300 (the shell sees 44)" in " ".join(traced.stderr.split())
    write(tmp_path / "unload.py", """
        import sys
        import torch
        import torch.nn.functional as F
        x = torch.randn(1, 1, 4, 8)
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
        del sys.modules["torch"]  # the report imported torch again: "unexpected RuntimeError: Only a single TORCH_LIBRARY"
        print("unloaded")
    """)
    plain, traced = run_both(tmp_path, ["unload.py"])
    assert plain.returncode == traced.returncode == 0 and traced.stdout == plain.stdout == "unloaded\n"
    assert traced.stderr.startswith(REPORT + "unload.py: 1 attention call in 1 group")
    write(tmp_path / "batch0.py", """
        import torch
        import torch.nn.functional as F
        z = torch.randn(0, 2, 4, 8)
        print(F.scaled_dot_product_attention(z, z, z, attn_mask=torch.ones(0, 2, 4, 4, dtype=torch.bool)).shape)
    """)
    plain, traced = run_both(tmp_path, ["batch0.py"])
    assert plain.returncode == traced.returncode == 0 and traced.stdout == plain.stdout == "torch.Size([0, 2, 4, 8])\n"
    assert "empty: 0 batch rows, 4 queries, 4 keys" in " ".join(traced.stderr.split())


def test_options_end_at_the_module_as_pythons_do(tmp_path):
    """`trace -m pkg -m pkg.other` ran pkg.other (its second -m taken as trace's); python runs pkg with the arguments
    -m pkg.other, and so does trace now, in every spelling of -m."""
    write(tmp_path / "pkg" / "__init__.py", "")
    write(tmp_path / "pkg" / "__main__.py", "import sys\nprint('pkg', sys.argv[1:])\n")
    write(tmp_path / "pkg" / "other.py", "import sys\nprint('other', sys.argv[1:])\n")
    for spelling in (["-m", "pkg"], ["-mpkg"], ["--module=pkg"], ["--module", "pkg"]):
        plain = subprocess.run([sys.executable, "-m", "pkg", "-m", "pkg.other", "--json", "x"], cwd=tmp_path,
                               capture_output=True, text=True, timeout=300)
        traced = subprocess.run([sys.executable, "-m", "maskcli", "trace", *spelling, "-m", "pkg.other", "--json", "x"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=300,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert plain.stdout == traced.stdout == "pkg ['-m', 'pkg.other', '--json', 'x']\n", (spelling, traced.stderr)
        assert traced.returncode == 0 and traced.stderr.startswith(REPORT + "-m pkg: 0 attention calls")


def test_a_program_started_with_stdout_closed_runs_as_under_python(tmp_path):
    """`maskcli trace prog.py >&-` refused ("stdout is closed") where python runs the program (its prints go nowhere):
    trace's stdout is the program's, its report on stderr."""
    write(tmp_path / "prog.py", """
        import torch
        import torch.nn.functional as F
        x = torch.randn(1, 1, 4, 8)
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
        print("nowhere")
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    done = [subprocess.run(command, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True, timeout=300,
                           preexec_fn=lambda: os.close(1))
            for command in ([sys.executable, "prog.py"], [sys.executable, "-m", "maskcli", "trace", "prog.py"])]
    assert done[0].returncode == done[1].returncode == 0 and done[0].stderr == ""
    assert done[1].stderr.startswith(REPORT + "prog.py: 1 attention call in 1 group")


def with_attend(body: str) -> str:
    """A program with attend(length, causal) defined first: one SDPA call over `length` tokens."""
    return textwrap.dedent(CALL) + textwrap.dedent(body)


CALL = """
    import torch
    import torch.nn.functional as F
    def attend(length=4, causal=True):
        x = torch.randn(1, 1, length, 8)
        return F.scaled_dot_product_attention(x, x, x, is_causal=causal)
"""


def test_a_program_that_ends_by_os_exit_is_reported_and_ends_as_under_python(tmp_path):
    """os._exit(n) ended the process before trace's report (exit n, nothing said): the report is written, --json
    too, and the rest is os._exit's: no finally block, no atexit function, the program's unflushed output lost; a
    status of the wrong type raises where it is called; from a thread, it ends the program there."""
    write(tmp_path / "prog.py", with_attend("""
        import atexit, os, sys
        atexit.register(print, "atexit ran")
        try:
            attend()
            try:
                os._exit("five")
            except TypeError as error:
                print(error, flush=True)
            sys.stdout.write("unflushed")
            os._exit(5)
        finally:
            print("finally ran")
    """))
    plain, traced = run_both(tmp_path, ["prog.py"], ["--json", "out.json"], buffered=True)
    assert plain.returncode == traced.returncode == 5
    assert traced.stdout == plain.stdout == "'str' object cannot be interpreted as an integer\n"
    assert traced.stderr.startswith(REPORT + "prog.py: 1 attention call in 1 group; the program exited with")
    assert json.loads((tmp_path / "out.json").read_text())["exit_status"] == 5
    write(tmp_path / "thread.py", with_attend("""
        import os, threading, time
        attend()
        def end():
            print("ending", flush=True)
            os._exit(7)
        threading.Thread(target=end).start()
        time.sleep(60)
        print("not reached")
    """))
    plain, traced = run_both(tmp_path, ["thread.py"])
    assert plain.returncode == traced.returncode == 7 and traced.stdout == plain.stdout == "ending\n"
    assert traced.stderr.startswith(REPORT + "thread.py: 1 attention call in 1 group")


def test_threads_left_running_at_the_end_are_joined_or_stopped_as_python_does(tmp_path):
    """Python joins the non-daemon threads (and stops the executors' workers once their work is done) before it
    exits: their calls were missing from the report ("0 attention calls"). Daemon threads it stops where they are:
    one that wakes later never prints (trace's report took longer than its sleep), and one inside a torch operator
    when the program ends aborts the process as it aborts python."""
    write(tmp_path / "joined.py", with_attend("""
        import concurrent.futures, threading, time
        def late(length):
            time.sleep(0.3)
            attend(length, causal=False)
        threading.Thread(target=late, args=(5,)).start()
        pool = concurrent.futures.ThreadPoolExecutor(2)
        for length in (6, 7, 8):
            pool.submit(late, length)
        print("main done")
    """))
    plain, traced = run_both(tmp_path, ["joined.py"], ["--json", "out.json"])
    assert plain.returncode == traced.returncode == 0 and traced.stdout == plain.stdout == "main done\n"
    calls = json.loads((tmp_path / "out.json").read_text())["calls"]
    assert sorted(call["shape"][-1] for call in calls) == [5, 6, 7, 8]
    write(tmp_path / "sleeper.py", with_attend("""
        import threading, time
        big = torch.randn(1500, 1500)
        (big @ big).sum()  # (OpenMP's threads started, as a real program's are: the forked report runs on one)
        for length in [*range(2, 40), 512]:  # (a report of some length)
            attend(length, causal=bool(length % 2))
        def wake():
            time.sleep(2)  # (long past the program's end: under load 0.05 s let the untraced one wake too)
            print("daemon woke", flush=True)
        threading.Thread(target=wake, daemon=True).start()
        print("main done", flush=True)
    """))
    plain, traced = run_both(tmp_path, ["sleeper.py"])
    assert plain.returncode == traced.returncode == 0 and traced.stdout == plain.stdout == "main done\n"
    assert traced.stderr.startswith(REPORT + "sleeper.py: 39 attention calls")
    write(tmp_path / "busy.py", with_attend("""
        import threading, time
        def spin():
            while True:
                attend(64)
        threading.Thread(target=spin, daemon=True).start()
        time.sleep(0.2)
        print("main done")
    """))
    plain, traced = run_both(tmp_path, ["busy.py"])
    assert plain.returncode == -signal.SIGABRT and traced.returncode == plain.returncode
    assert traced.stdout == plain.stdout == "main done\n" and REPORT + "busy.py: " in traced.stderr


def test_a_program_that_sets_sys_excepthook_gets_it_called_as_python_calls_it(tmp_path):
    """Its uncaught error went to the default traceback, past the program's own hook (and its stdout line)."""
    write(tmp_path / "hook.py", """
        import sys
        sys.excepthook = lambda kind, error, tb: print("custom hook", kind.__name__, error)
        raise ValueError("x")
    """)
    plain, traced = run_both(tmp_path, ["hook.py"])
    assert plain.returncode == traced.returncode == 1
    assert traced.stdout == plain.stdout == "custom hook ValueError x\n" and plain.stderr == ""
    assert traced.stderr.startswith(REPORT + "hook.py: 0 attention calls")
    write(tmp_path / "broken.py", """
        import sys
        def hook(*args):
            raise RuntimeError("the hook fails")
        sys.excepthook = hook
        raise ValueError("x")
    """)
    plain, traced = run_both(tmp_path, ["broken.py"])
    assert plain.returncode == traced.returncode == 1
    assert "Error in sys.excepthook:" in plain.stderr and traced.stderr.startswith(plain.stderr)


def test_a_thread_printing_in_a_loop_is_stopped_at_its_next_write_holding_no_lock_of_the_stream(tmp_path, monkeypatch):
    """ending._hold_streams, before the report holds the interpreter: a daemon thread that prints without pause is let
    finish the write it is in and then waits at its next one (in _Held, not inside the stream, whose lock python's
    exit flush needs: "_enter_buffered_busy" aborted most traced runs of such a program, 20 of 20 before, where python
    aborted 1 of 20); the thread that holds the streams writes through them."""
    import threading
    import time

    from maskcli.trace import ending

    path = tmp_path / "out.txt"
    stream = open(path, "w", encoding="utf-8")  # noqa: SIM115 - a buffered file, as stdout is when not a terminal
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "stderr", sys.stderr)  # (put back after: _hold_streams holds it too)

    def spam():
        while True:
            print("spam " * 8)

    thread = threading.Thread(target=spam, daemon=True)
    thread.start()
    time.sleep(0.05)
    ending._hold_streams()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # (it stops at its next print, once it runs again)
        frame = sys._current_frames().get(thread.ident)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if "_mine" in names:
            break
        time.sleep(0.01)
    assert "_mine" in names and "spam" in names
    size = path.stat().st_size
    time.sleep(0.05)
    print("main done")
    sys.stdout.flush()
    text = path.read_text()
    assert text.endswith("main done\n") and len(text) == size + len("main done\n")
    assert set(text.splitlines()[:-1]) == {"spam " * 8}
    stream.close()


@pytest.mark.parametrize(("body", "stdout", "stderr"), [
    # str() of the code raises: python writes the newline alone (trace: "unexpected RuntimeError ... a maskcli bug")
    ("class Code:\n    def __str__(self):\n        raise RuntimeError('no str')\nsys.exit(Code())\n", "", "\n"),
    ("sys.stderr = None\nsys.exit('bye')\n", "", "bye\n"),  # python writes it to fd 2 (trace printed it on stdout)
    ("sys.stderr.close()\nsys.exit('bye')\n", "", "\n"),  # the newline on fd 2 (trace exited 2, saying nothing)
])
def test_sys_exit_with_a_message_that_cannot_be_printed_ends_as_under_python(tmp_path, body, stdout, stderr):
    """Hunt 9b: sys.exit(CODE) with a CODE that is no int: str(CODE) and a newline on sys.stderr, fd 2 where it is
    None, dropped where it cannot be written (the newline then on fd 2), and status 1 always, as Python's handle_system_exit does."""
    write(tmp_path / "ends.py", "import sys\n" + body)
    plain, traced = run_both(tmp_path, ["ends.py"])
    assert plain.returncode == traced.returncode == 1
    assert plain.stdout == traced.stdout == stdout
    assert plain.stderr == stderr and traced.stderr.startswith(stderr + REPORT + "ends.py: 0 attention calls")


@pytest.mark.parametrize(("body", "status"), [
    ("builtins.int = None\nsys.exit(3)\n", 3),  # trace: "unexpected TypeError: isinstance() arg 2 must be a type"
    ("builtins.str = None\nsys.exit('bye')\n", 1),  # trace dropped the message
    ("builtins.len = None\nraise ValueError('v')\n", 1),  # trace: "unexpected TypeError: 'NoneType' object ..."
    ("builtins.isinstance = None\nraise ValueError('v')\n", 1),  # trace: "Error in sys.excepthook:" (Typer's hook)
    ("sys.excepthook = lambda *a: print('hook', len(a))\nbuiltins.len = lambda x: 42\nraise ValueError('v')\n", 1),
])
def test_a_program_that_replaces_builtins_ends_as_under_python(tmp_path, body, status):
    """Hunt 9b: python reads a program's exit and prints its traceback in C, whatever it made of int, str, len or
    isinstance; trace read them with the program's builtins. Its own sys.excepthook still runs with them."""
    write(tmp_path / "ends.py", "import builtins\nimport sys\n" + body)
    plain, traced = run_both(tmp_path, ["ends.py"])
    assert plain.returncode == traced.returncode == status and plain.stdout == traced.stdout
    assert traced.stderr.startswith(plain.stderr + REPORT + "ends.py: 0 attention calls")


@pytest.mark.parametrize("target", [["names.py"], ["-m", "names"]])
def test_the_programs_main_holds_pythons_names_with_an_empty_annotations(tmp_path, target):
    """Hunt 9b: python's __main__ holds __annotations__ = {} (a program printing it, or typing.get_type_hints of its
    module, ended in NameError under trace)."""
    write(tmp_path / "names.py", "print(sorted(name for name in globals() if name.startswith('__')), __annotations__)\n")
    plain, traced = run_both(tmp_path, target)
    assert plain.returncode == traced.returncode == 0 and traced.stdout == plain.stdout
    assert "'__annotations__'" in traced.stdout


@pytest.mark.parametrize(("body", "status"), [
    ("import traceback\ntraceback.print_exception = None\nraise ValueError('v')\n", 1),
    ("sys.exc_info = None\nraise ValueError('v')\n", 1),
    ("import os.path\nos.path.abspath = None\nraise ValueError('v')\n", 1),
    ("import os\nos.chdir = None\n", 0),
    ("import contextlib\ncontextlib.suppress = None\nsys.exit('bye')\n", 1),
    ("sys.path = None\n", 0),
])
def test_a_program_that_replaces_what_the_trace_calls_after_it_ends_as_under_python(tmp_path, body, status):
    """Hunt 9b: trace's own code after the program (its traceback, its exit message, going back to the folder it
    began in, sys.path put back) called what the program had replaced: "unexpected TypeError ... a maskcli bug"."""
    write(tmp_path / "ends.py", "import sys\n" + body)
    plain, traced = run_both(tmp_path, ["ends.py"])
    assert plain.returncode == traced.returncode == status and plain.stdout == traced.stdout
    assert traced.stderr.startswith(plain.stderr + REPORT + "ends.py: 0 attention calls")


def test_a_program_that_replaces_json_tempfile_or_numpy_still_gets_its_trace_written(tmp_path):
    """Hunt 9b: --json and --save wrote with the program's json.dump, tempfile.mkstemp and numpy: "unexpected
    TypeError ... a maskcli bug", or "cannot write ...: TypeError (is the disk full?)", and no file."""
    write(tmp_path / "swaps.py", """
        import json, tempfile
        import numpy as np
        import torch
        import torch.nn.functional as F
        x = torch.randn(1, 1, 4, 8)
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
        json.dump, tempfile.mkstemp, np.packbits, np.asarray = None, None, None, None
    """)
    plain, traced = run_both(tmp_path, ["swaps.py"], ["--json", "calls.json", "--save", "calls.pt"])
    assert plain.returncode == traced.returncode == 0, traced.stderr
    assert json.loads((tmp_path / "calls.json").read_text())["calls"][0]["api"] == "sdpa"
    assert (tmp_path / "calls.pt").stat().st_size > 0


def test_the_largest_recursion_limit_python_takes_is_taken_and_read_back(tmp_path):
    """Hunt 9b: sys.setrecursionlimit(2**31 - 1) runs under python; trace added its own frames to it and raised
    "OverflowError: Python int too large to convert to C int" in the program."""
    write(tmp_path / "top.py", "import sys\nsys.setrecursionlimit(2**31 - 1)\nprint(sys.getrecursionlimit())\n"
                               "sys.setrecursionlimit(2**31)\n")
    plain, traced = run_both(tmp_path, ["top.py"])
    assert plain.returncode == traced.returncode == 1 and plain.stdout == traced.stdout == f"{2**31 - 1}\n"
    assert "OverflowError" in plain.stderr and traced.stderr.startswith(plain.stderr)


def test_a_program_that_blocks_numpy_in_sys_modules_still_gets_its_report(tmp_path):
    """Hunt 9b: sys.modules["numpy"] = None, left by the program, stopped the report: "unexpected ModuleNotFoundError:
    import of numpy halted; None in sys.modules (a maskcli bug ...)", exit 2."""
    write(tmp_path / "blocks.py", "import sys\nsys.modules['numpy'] = None\nprint('blocked')\n")
    plain, traced = run_both(tmp_path, ["blocks.py"])
    assert plain.returncode == traced.returncode == 0 and plain.stdout == traced.stdout == "blocked\n"
    assert traced.stderr.startswith(REPORT + "blocks.py: 0 attention calls")


@pytest.mark.parametrize(("body", "shown"), [
    ("sys.stdout = W()\nprint('lost')\n", True),
    ("sys.stderr = W()\nprint('kept')\nsys.exit(3)\n", False),
])
def test_a_stream_whose_flush_raises_at_the_end_exits_120_as_under_python(tmp_path, body, shown):
    """Hunt 9b: python's exit flushes sys.stdout and sys.stderr and exits 120 where either raises (stdout's error
    printed as an unraisable one); trace suppressed both and exited 0 (or the program's 3)."""
    stream = "class W:\n    def write(self, s):\n        return len(s)\n    def flush(self):\n        raise OSError('no flush')\n"
    write(tmp_path / "flushes.py", "import sys\n" + stream + body)
    plain, traced = run_both(tmp_path, ["flushes.py"])
    assert plain.returncode == traced.returncode == 120 and plain.stdout == traced.stdout
    assert ("Exception ignored in: <__main__.W object at" in plain.stderr) is shown
    at = lambda text: re.sub(r"0x[0-9a-f]+", "0x", text)  # noqa: E731 - the object's address differs run to run
    assert at(traced.stderr).startswith(at(plain.stderr) + REPORT + "flushes.py: 0 attention calls")


def test_a_program_that_clears_sys_modules_still_gets_its_report(tmp_path):
    """Hunt 9b: sys.modules.clear() left the report importing a `sys` of its own: "unexpected AttributeError: module
    'sys' has no attribute 'warnoptions' (a maskcli bug ...)", exit 2."""
    write(tmp_path / "clears.py", """
        import sys
        import torch
        import torch.nn.functional as F
        x = torch.randn(1, 1, 4, 8)
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
        sys.modules.clear()
        print("cleared")
    """)
    plain, traced = run_both(tmp_path, ["clears.py"])
    assert plain.returncode == traced.returncode == 0 and plain.stdout == traced.stdout == "cleared\n"
    assert traced.stderr.startswith(REPORT + "clears.py: 1 attention call in 1 group"), traced.stderr


def test_a_program_that_replaces_torch_save_still_gets_its_calls_saved(tmp_path):
    """Hunt 9b: torch.save = None left by the program: "cannot write 'calls.pt': TypeError: 'NoneType' object is not
    callable (is the disk full?)", exit 2, where the disk was fine."""
    write(tmp_path / "saves.py", """
        import torch
        import torch.nn.functional as F
        x = torch.randn(1, 1, 4, 8)
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
        torch.save = None
    """)
    plain, traced = run_both(tmp_path, ["saves.py"], ["--save", "calls.pt"])
    assert plain.returncode == traced.returncode == 0, traced.stderr
    assert (tmp_path / "calls.pt").stat().st_size > 0 and "wrote " in traced.stderr


def test_the_program_does_not_import_stray_modules_of_the_folder_maskcli_was_started_from(tmp_path):
    """`python -m maskcli` puts the current folder first on sys.path (and the console script its bin folder), where
    `python SCRIPT` puts only the script's folder: a program run from a folder of stray scripts imported them in place
    of the library's (a blind writer's Decision Transformer, traced from /tmp, failed on a dtype another module set)."""
    write(tmp_path / "work" / "shadowed.py", "print('the stray module of the current folder')\n")
    write(tmp_path / "prog" / "prog.py", """
        import sys
        try:
            import shadowed
        except ImportError:
            print("no module named shadowed, as python has it")
        print(len([p for p in sys.path if p.endswith("work") or p == ""]))
    """)
    plain, traced = run_both(tmp_path / "work", [str(tmp_path / "prog" / "prog.py")])
    assert plain.stdout == "no module named shadowed, as python has it\n0\n", plain.stderr
    assert traced.stdout == plain.stdout, traced.stderr
    module_plain, module_traced = run_both(tmp_path / "prog", ["-m", "prog"])  # (-m: the current folder first, both)
    assert module_traced.stdout == module_plain.stdout, module_traced.stderr
