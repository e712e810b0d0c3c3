"""Renderers: what the user sees of a mask (tables, maps, figures, JSON); commands print or save what they build."""

from __future__ import annotations

from maskcli.errors import MaskError

JSON_MAX_VALUES = 1 << 22  # numbers --json prints at most (a few seconds, about 12 MB); past it, a file or counts


def check_json_size(count: int, what: str, fix: str) -> None:
    """Refuse --json that would list more than JSON_MAX_VALUES `what`, up front: before anything is built or written."""
    if count > JSON_MAX_VALUES:
        raise MaskError(f"--json would list {count:,} {what}, past the {JSON_MAX_VALUES:,} it prints: {fix}")


def hanging(lead: str, text, style: str | None = None):
    """A rich renderable of `lead` then `text`, whose wrapped lines stand under the text, not under `lead`; a word
    longer than the line (a command's expression) is broken, never cut short."""
    from rich.table import Table

    grid = Table.grid()
    grid.style = style or ""
    grid.add_column(no_wrap=True)
    grid.add_column(overflow="fold")
    grid.add_row(lead, text)
    return grid
