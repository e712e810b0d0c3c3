"""The one exception type the core raises for bad input."""


class MaskError(ValueError):
    """Bad input from the user: the message quotes the value and says how to fix it.

    Only the CLI turns it into a line on stderr and exit status 2; library callers
    catch it like any ValueError. `pointer` (the text and a position in it) is drawn as a
    caret line under the text, on a terminal only: a script reading stderr gets one line.
    """

    def __init__(self, message: str, pointer: tuple[str, int] | None = None):
        super().__init__(message)
        self.pointer = pointer


class Stopped(SystemExit):
    """A kill or a closed terminal (SIGTERM, SIGHUP), raised from the signal handler so that files being
    written are removed on the way out; exit status 128 + the signal's number. Never a user's code's fault:
    code that catches what a user's function raises lets this one through."""
