"""The command line: one module per command, all registered on commands.app.app (in this order in --help).

Each command runs the flow once: it takes a mask in (described, given, captured, or implied by metadata), has it made
one Mask on absolute positions, checks it by the rules of maskcli.checks, and prints or saves a view of it (render/,
formats/); it is the only layer that prints an error and exits. docs/architecture.md draws the whole flow.
"""

from maskcli.commands import show  # noqa: F401, I001  (each import registers its commands)
from maskcli.commands import blocks, diff  # noqa: F401
from maskcli.commands import attend, verify  # noqa: F401
from maskcli.commands import inspect, kinds  # noqa: F401
from maskcli.commands import trace  # noqa: F401
from maskcli.commands import pack  # noqa: F401
from maskcli.commands import export  # noqa: F401
from maskcli.commands import model  # noqa: F401
from maskcli.commands import shard  # noqa: F401
from maskcli.commands import serve  # noqa: F401
from maskcli.commands.app import app


def main() -> None:
    import os
    import sys

    from maskcli.commands.app import quiet_stdout

    for stream in (sys.stdout, sys.stderr):  # an ASCII or Latin-1 terminal gets '?' for █ and ·, not a traceback
        try:
            stream.reconfigure(errors="replace")
        except (AttributeError, ValueError):
            pass
    import signal

    from maskcli.errors import Stopped

    def stop(number, frame):  # a kill or a closed terminal ends like Ctrl-C: files being written are removed
        raise Stopped(128 + number)

    from maskcli.commands.app import OWN_PROCESS, SIGNALS

    OWN_PROCESS.append(True)

    for name in ("SIGTERM", "SIGHUP"):
        number = getattr(signal, name, None)
        if number is None:
            continue
        SIGNALS[number] = signal.getsignal(number)
        if SIGNALS[number] is not signal.SIG_IGN:  # ignored stays ignored: nohup's SIGHUP
            signal.signal(number, stop)
    try:
        app()
    except SystemExit as done:
        try:
            if sys.stdout is not None and not sys.stdout.closed:  # None: started with stdout closed (>&-); closed:
                sys.stdout.flush()  # by a traced program. Here, not at exit: a reader that went away (| head) is a quiet stop
        except BrokenPipeError:
            quiet_stdout()
            raise SystemExit(141) from None
        run = sys.modules.get("maskcli.trace.run")
        if run is not None and run.interrupted and done.code == 130:  # a traced program's KeyboardInterrupt: python
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # ends by SIGINT (its parent sees a signal, not status 130)
            os.kill(os.getpid(), signal.SIGINT)
        raise done
