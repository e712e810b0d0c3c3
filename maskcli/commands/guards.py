"""What the command line and the environment hand maskcli, made safe before click and rich read them: arguments
with a NUL byte, and COLUMNS or LINES that are no number, or too small or too large a width to draw at."""

from __future__ import annotations

from maskcli.errors import MaskError
from maskcli.text import shortened


def no_nul(args: list[str]) -> None:
    """A NUL byte ends a C string: no file name or value holds one (a shell cannot pass one; a caller in Python can)."""
    for arg in args:
        if isinstance(arg, str) and "\x00" in arg:
            raise MaskError(f"{shortened(arg, 60)!r} holds a NUL byte (\\x00), which no file name or value can hold: remove it")


MIN_COLUMNS = 40  # narrower than this, a table, a map or help has no room: it is drawn this wide
MAX_COLUMNS = 5000  # wider than this, a density map takes longer to draw than to read: it is drawn this wide


def floor_columns() -> None:
    """COLUMNS=0 (or 1) drew nothing, or one character a line, and exited 0: take it as MIN_COLUMNS; COLUMNS or LINES
    that are no number (COLUMNS=²) are dropped."""
    import os

    for name in ("COLUMNS", "LINES"):  # rich reads them with str.isdigit, which takes '²', then int() fails on it
        value = os.environ.get(name)
        if value is not None and not (value.strip().isascii() and value.strip().isdigit()):
            del os.environ[name]  # not a number: the terminal's own size, as where it is unset
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) < MIN_COLUMNS:
        os.environ["COLUMNS"] = str(MIN_COLUMNS)
    elif columns.isdigit() and int(columns) > MAX_COLUMNS:  # 10^23 columns: a map never drawn, help an OverflowError
        os.environ["COLUMNS"] = str(MAX_COLUMNS)
