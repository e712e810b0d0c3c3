"""A query that sees keys the same mask calls padding everywhere else: a token prepended to a padded set or sequence
whose row was never masked.

A square self-attention mask states which of its tokens are padding where it hides a token from its own query (its
own cell) and from the real queries around it: a padding mask made from valid tokens (`valid[:, None] & valid[None]`,
HF's key mask over every row) does both. Where one real query (its own cell kept, and its key seen by most of the
other real queries: a token of the text, not a padding row) still sees such a padding key that at least two other
real queries do not, the mask contradicts itself for that query: its row was built apart from the padding (theislab/
CellFlow#226: TokenAttentionPooling prepends a CLS token to a padded set, copies the set's mask into `[1:, 1:]` and
leaves the CLS row all ones, so the pooled embedding attends the padded elements). Left alone: a batch row whose
tokens hidden from themselves see one another (no padding: GraphCodeBERT's data-flow nodes, linked by their edges and
seen by their code spans, none by itself), a mask that hides no
token's own cell (padding rows that attend each other), a padding row unmasked whole (transformers' SDPA unmasking of
fully masked left-padding rows: its key is hidden from every real query, so it is not read as real), a causal mask
(a real query never sees later keys: the last token's key is seen by none), cross-attention and one query.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.gatheredrows import gathered_rows
from maskcli.checks.registry import Rule
from maskcli.checks.topk import reading
from maskcli.text import Finding


def against(cells: np.ndarray) -> np.ndarray:
    """Bool (B, L, L): real queries that see a key the mask calls padding, for a keep mask `cells` (B, L, L)."""
    rows, length, _ = cells.shape
    at = np.arange(length)
    own = cells[:, at, at]  # (B, L): a token's own cell kept
    if own.all() or not own.any():
        return np.zeros_like(cells)  # (no token the mask calls padding, or none real: most masks, read at once)
    seen = cells & own[:, :, None]  # (by queries whose own cell is kept)
    others = seen.sum(axis=1) - own  # (B, L): the other own-kept queries that see each key
    count = own.sum(axis=1, keepdims=True) - 1  # (B, 1): own-kept queries other than the token itself
    real = own & (2 * others >= count) & (count >= 2)  # (a key most other real queries see: a token of the text)
    found = np.zeros_like(cells)
    hidden = np.flatnonzero((~own).any(axis=0))  # (only a key hidden from its own query can be padding: read those)
    pad = ~own[:, hidden] & ((real[:, :, None] & ~cells[:, :, hidden]).sum(axis=1) >= 2)  # (hidden from itself and
    # from two real queries)
    found[:, :, hidden] = cells[:, :, hidden] & real[:, :, None] & pad[:, None, :]
    linked = (cells & ~own[:, :, None] & ~own[:, None, :]).any(axis=(1, 2))  # (B,): tokens hidden from themselves that
    # see each other are a kind of token, not padding (GraphCodeBERT's data-flow nodes, linked by their edges)
    found[linked] = False
    return found


def seen_by_few(run: Run) -> list:
    found, done = [], {}
    for call in run.calls:
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        if q_len != k_len or q_len < 3 or call.stored is None or cross(call) or reading(call) or gathered_rows(call):
            continue  # (a sparse top-k hides keys by score, not as padding: checks/topk.py; rows gathered: gatheredrows.py)
        key = (call.mask, call.shape)
        if key not in done:
            done[key] = _finding(call, rows, q_len)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call, rows: int, length: int) -> Finding | None:
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, rows):
        return None
    heads = cells.shape[1]
    for h in range(heads):
        bad = against(cells[:, h])
        if bad.any():
            b, q, k = first_cell(bad)
            at = np.arange(length)
            own = cells[b, h, at, at]
            hidden = int((own & ~cells[b, h, :, k]).sum())
            return Finding("padding-seen-by-one", (
                f"batch row {b}: query {q} sees key {k}, which the same mask calls padding: it hides key {k} from its "
                f"own query and from {hidden} of the {int(own.sum())} queries that see themselves ({int(bad.sum())} such "
                f"cells): a "
                f"token's row built apart from the padding (a CLS or summary token prepended or appended, its row left all ones?)"),
                expected="no real query sees a key the mask calls padding", source="the mask's own padding",
                cell=(b, q, k))
    return None


RULES = (
    Rule("padding-seen-by-one", "wrong", "call", "a real query that sees keys the same square mask calls padding "
         "(hidden from their own query and from the other real queries): a prepended token's row left unmasked",
         seen_by_few),
)
