"""A head of one batch row masked with another batch row's mask: the cells it alone hides are another row's.

Every head of a batch row attends over the same tokens; where a mask is made per (batch row, head) by hand, as
nn.MultiheadAttention's 3-D `attn_mask` (B * heads, L, S) is, `.repeat(heads, 1, 1)` lays row r's mask on heads of
other rows where `.repeat_interleave(heads, 0)` was meant (line/lighthouse#77, CLIP4Clip#22). Said where, in one
batch row, a head hides cells that another head of the row shows, and every such cell is
hidden in the batch row whose mask `.repeat` lays on that head (flattened index b * heads + h, taken modulo the
batch), in each of its heads that `.repeat` leaves its own mask, and every such cell's key is one the call's own
key-padding argument (nn.MultiheadAttention's key_padding_mask) calls real in this row and padding in that one:
the differing head carries that row's padding. (A head with a window of its own hides other cells too: a repeat
laid on it is not said.) A key hidden from every
query of a head (heads.py's padding-per-head) is said there; this reads any call, cross-attention included (a
video's clips over its text: no query is a key's own). Heads that differ by their own windows or sinks hide cells
the row `.repeat` names does not hide, so they are quiet.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.keypadding import valid
from maskcli.text import Finding


def another_row(run: Run) -> list:
    """Calls where a head of a batch row hides, beyond its row's other heads, only cells another row hides in every head."""
    found, done = [], {}
    for call in [*run.calls, *run.cross]:
        rows, heads, q_len, k_len = call.shape
        if rows < 2 or heads < 2 or call.stored is None:
            continue
        key = (call.mask, call.shape)
        given = call.details.get("key_padding")
        helds = [held["rows"] for held in call.details.get("held_padding") or () if held.get("kind") == "cells"]
        key = (*key, tuple(id(table) for table in helds))
        if key not in done:
            done[key] = None
            if given:  # (the call's own key-padding argument says which keys are each row's padding)
                done[key] = _finding(keep(call), rows, heads, valid(given, rows, k_len))
            for held in call.details.get("held_padding") or ():
                if done[key] is None and held.get("kind") == "cells":  # (a (B, Lq, Lk) mask the program holds)
                    done[key] = _held_finding(keep(call), rows, heads, held)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(cells, rows: int, heads: int, real: np.ndarray) -> Finding | None:
    if cells is None or cells.shape[1] != heads or cells.shape[0] not in (1, rows) or real.shape[0] != rows:
        return None  # (heads that repeat were kept once: no head differs)
    cells = np.broadcast_to(cells, (rows, *cells.shape[1:]))
    for b in range(rows):
        shown = cells[b].any(axis=0)  # cells some head of the row shows
        for h in range(heads):
            extra = shown & ~cells[b, h]  # cells this head hides that another head of its row shows
            if not extra.any():
                continue
            other = (b * heads + h) % rows  # the row whose mask `.repeat(heads, 1, 1)` lays on this head
            own = [g for g in range(heads) if (other * heads + g) % rows == other]  # that row's heads that keep its own
            if other == b or not own or (extra & cells[other, own].any(axis=0)).any() \
                    or (extra & ~(real[b] & ~real[other])[None, :]).any():
                continue  # (only keys real in this row that the call's key padding pads in the other: its padding)
            q, k = (int(x) for x in np.argwhere(extra)[0])
            return Finding("mask-of-another-row", (
                f"batch row {b}: head {h} hides query {q} from key {k} ({int(extra.sum())} cells) where the row's "
                f"other heads show it, and batch row {other} hides every one of those cells in the heads that keep its own: row "
                f"{other}'s mask laid on this head (a (B * heads, L, S) mask built with repeat, not repeat_interleave?)"),
                expected="every head of a batch row masks alike", source="the other heads of the same batch row",
                cell=(b, q, k))
    return None


def _held_finding(cells, rows: int, heads: int, held: dict) -> Finding | None:
    """A head of batch row b that runs with exactly the cells of another row o of a (B, Lq, Lk) mask the program holds
    at the call (read either way round, as its name does not say its polarity), where its own row's differ: row o's
    mask laid on this head (a (B, Lq, Lk) mask broadcast over (B, heads, Lq, Lk) scores: head h gets row h's; or repeat
    for repeat_interleave: head h of row b gets row (b * heads + h) % B's)."""
    table = held["rows"]
    if cells is None or table.ndim != 3 or cells.shape[1] != heads or table.shape[1:] != cells.shape[2:]:
        return None
    if table.shape[0] != rows or cells.shape[0] not in (1, rows):
        return None  # (a call of one request under the batch's mask is heldcells.py's)
    cells = np.broadcast_to(cells, (rows, *cells.shape[1:]))
    for reading in (table, ~table):  # (True = keep; True = masked)
        if not any((cells[b, h] == reading[b]).all() for b in range(rows) for h in range(heads)):
            continue  # (no head runs with its own row's cells read this way round: not the mask's polarity)
        for b in range(rows):
            for h in range(heads):
                plane = cells[b, h]
                if (plane == reading[b]).all():
                    continue  # (its own row's cells)
                other = next((o for o in range(rows) if o != b and (plane == reading[o]).all()), None)
                if other is None:
                    continue
                q, k = first_cell(plane != reading[b])
                how = ("a (B, Lq, Lk) mask broadcast over the heads axis: head h gets batch row h's mask (unsqueeze(1) "
                       "to (B, 1, Lq, Lk)?)") if other == h else ("repeat for repeat_interleave?" if other ==
                                                                  (b * heads + h) % rows else "another row's mask?")
                said = f"{held['name']} in {held['where']}"
                return Finding("mask-of-another-row", (
                    f"batch row {b}: head {h} runs with batch row {other}'s cells of {said} "
                    f"({tuple(table.shape)}), not its own: query {q} {'sees' if plane[q, k] else 'is hidden from'} key {k}, "
                    f"which row {b}'s {'hides' if plane[q, k] else 'shows'} ({int((plane != reading[b]).sum())} cells): "
                    f"{how}"), expected=f"batch row {b}'s cells of {held['name']}", source=said, cell=(b, q, k))
    return None


RULES = (
    Rule("mask-of-another-row", "wrong", "call", "a head of a batch row that hides, beyond its row's other heads, only "
         "cells another batch row hides in every head: that row's mask laid on this head (repeat for repeat_interleave)",
         another_row),
)
