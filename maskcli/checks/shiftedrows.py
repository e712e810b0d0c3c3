"""A cross-attention mask whose query rows are padded on the other side than the text: its rows no longer line up.

A vision-language model's cross-attention mask is built per sample, one row per text token (torchtune's
VisionCrossAttentionMask: the rows from each image token on see that image), then padded to the batch's longest text
by a collate. Where the tokens are left-padded (for generation) but each mask is still padded at the bottom, row i of
the mask belongs to the sample's token i and lands on position i of the padded row, p positions before that token
(meta-pytorch/torchtune#1601): the padding positions carry the rows built for real tokens, and the real tokens the
rows of others. What the program states: the text's padding (the model call's ids at the pad id it names, a mask of
its tokens: checks/real.py's `stated`, read outright; else the positions the self-attention mask the model call was
handed over its tokens isolates, each seeing only itself: torchtune's `tril & padding_mask | eye`). A query row that *selects* memory keys (sees some, not all:
a row that sees none, or every key, is one the mask leaves unmatched: a token before any image, unmasked against NaN)
carries a token's structure; where, in a padded batch row, some padding position selects, the padding rows do not all
see the same keys (they differ as the tokens' rows differ), and moved by the row's padding every selecting row lands on
a real token, the mask's rows were padded on the other side.

Quiet where no padding position selects (the rows line up), where every padding row sees the same keys
(a pad row's fixed pattern, kept against NaN), on an unpadded row, and where the text's padding is not stated outright.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.real import _edge, by_row, stated
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def rows_shifted(run: Run) -> list:
    """Cross-attention calls where padding positions of a padded row select memory keys, and every selecting row
    lies on a real token once moved by the row's padding."""
    found, done = [], set()
    for call in run.cross:
        top = run.top(call)
        rows, _, q_len, k_len = call.shape
        if top is None or call.stored is None or q_len < 2 or k_len < 2:
            continue
        key = (call.mask, call.shape, id(top))
        if key in done:
            continue
        done.add(key)
        text = stated(top, rows, q_len)
        text = text if text is not None and text[2] else isolated(top, rows, q_len)
        if text is None:
            continue
        cells = keep(call)
        if cells is None or cells.shape[0] not in (1, rows):
            continue
        finding = _shifted(by_row(cells, rows), ~text[0], text[1])
        if finding is not None:
            found.append((call, finding))
    return found


def isolated(top, rows: int, length: int) -> tuple[np.ndarray, str, bool] | None:
    """(bool (rows, length) real tokens, what says it, True) read off the self-attention mask the model call was handed
    over its tokens (trace/handedcells.py, True = may attend): the positions it isolates, each seeing only itself and
    seen by no other (torchtune's `tril & padding_mask | eye`: a padding query kept on its own key against NaN), where
    they are a padded batch's (one run at an edge of each row, some row unpadded); None otherwise."""
    handed = top.arguments.get("handed_cells")
    if handed is None or handed[1].shape[1:] != (length, length) or handed[1].shape[0] not in (1, rows):
        return None
    name, cells = handed
    own = np.eye(length, dtype=bool)[None]
    alone = (cells == own).all(axis=2) & (cells == own).all(axis=1)  # (row k sees only k; column k seen only by k)
    alone = np.broadcast_to(alone, (rows, length))
    if not _edge(alone):
        return None
    return ~alone, f"positions the `{name}` handed to {top.where} isolates (each sees only itself)", True


def _shifted(cells: np.ndarray, pad: np.ndarray, source: str) -> Finding | None:
    for b in range(cells.shape[0]):
        count = int(pad[b].sum())
        if count == 0 or count == pad.shape[1]:
            continue
        left, right = bool(pad[b, :count].all()), bool(pad[b, -count:].all())
        if left == right:
            continue
        full, empty = cells[b].all(axis=-1), ~cells[b].any(axis=-1)
        selecting = ~full & ~empty
        if not (selecting & pad[b]).any():
            continue
        padded_rows = cells[b][pad[b]]
        if (padded_rows == padded_rows[0]).all():
            continue
        at = np.flatnonzero(selecting)
        moved = at + (count if left else -count)
        if moved.min() < 0 or moved.max() >= pad.shape[1] or pad[b, moved].any():
            continue
        side, other = ("left", "bottom") if left else ("right", "top")
        first = int(np.flatnonzero(cells[b, at[0]])[0])
        carried = np.flatnonzero(selecting & pad[b]).tolist()
        return Finding("memory-rows-shifted", (
            f"batch row {b}: its text is {side}-padded ({count} padding positions: the {source}), yet padding "
            f"positions {spans(carried)} select memory keys in the cross-attention mask, as a token's row does (the "
            f"rows that select are {spans(at.tolist())}); moved by the row's {count} pads they are real positions "
            f"{spans(moved.tolist())}: the mask's rows were padded at the {other} while the tokens were padded on the "
            f"{side}, so each token reads another's row (padding rows carry what the tokens were meant to see)"),
            expected=f"batch row {b}: the rows of positions {spans(at.tolist())} at positions {spans(moved.tolist())}",
            source=source, cell=(b, int(at[0]), first))
    return None


RULES = (
    Rule("memory-rows-shifted", "wrong", "call", "a cross-attention mask whose query rows were padded on the other side "
         "than the text: padding positions select memory keys, and moved by the row's padding every selecting row "
         "is a real token (torchtune#1601)", rows_shifted),
)
