"""A progress bar on stderr for long exact counting, shown only once the work has taken a second."""

from __future__ import annotations

import time
from contextlib import contextmanager


def now() -> float:
    return time.monotonic()


@contextmanager
def progress(what: str):
    """Yield a callback(done, total) for the core's long loops; it draws a bar after the first second."""
    start = now()
    state: dict = {}

    def update(done: int, total: int) -> None:
        if "bar" not in state:
            if now() - start < 1:
                return
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            console = Console(stderr=True)
            if not console.is_terminal:  # a log or a pipe: no bar (rich would still leave an empty line in it)
                state["bar"] = None
                return
            bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                           TimeRemainingColumn(), console=console, transient=True)
            bar.start()
            state["bar"], state["task"] = bar, bar.add_task(what, total=total)
        if state["bar"] is not None:
            state["bar"].update(state["task"], completed=done, total=total)

    try:
        yield update
    finally:
        if state.get("bar") is not None:
            state["bar"].stop()
