"""The one exception type the core raises for bad input."""


class MaskError(ValueError):
    """Bad input from the user: the message quotes the value and says how to fix it.

    Only the CLI turns it into a line on stderr and exit status 2; library callers
    catch it like any ValueError.
    """
