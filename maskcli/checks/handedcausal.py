"""A model call handed a mask whose queries see later keys in part (a prefix LM's), whose self-attention ran causal.

A (B, L, L) mask over the model call's tokens, handed to it as an argument (trace/handedcells.py: by name, or as an
item of a tuple `inputs` as Megatron's pipeline models take it), states for each query which keys it sees. Where it
states both directions at once (some real query sees a later real key: a prefix attended both ways; another real query
hides a later real key: the causal part after it), the program chose the direction per query, and a self-attention
call over those tokens that lets no real query see any later real key ran another mask than the one the model was
handed: its own causal mask, the handed one dropped on the way (bigscience-workshop/Megatron-DeepSpeed 5207386:
pretrain_ul2.py built the prefix-LM decoder with `pretrain_causal_attention=True`, so `EmbeddingPipe` dropped the
dataset's `dec_mask` and the softmax put its own triu on).

Its polarity is read off its own diagonal (each token sees itself: True = keep where the diagonal is True); its real
tokens are those whose own cell it keeps. Quiet on a handed mask that is causal, full or padding only (it states no
direction per query: a model may add its own causal part), on calls of another length or batch, and on
cross-attention.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep, triu
from maskcli.checks.real import by_row
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _read(table: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(keep cells, real tokens) of a handed mask, its polarity off its diagonal; None where the diagonal says neither."""
    own = np.diagonal(table, axis1=1, axis2=2)
    if own.mean() < 0.5:
        table, own = ~table, ~own
    if not own.any():
        return None
    return table, own


def made_causal(run: Run) -> list:
    """Self-attention calls that see no later real key where the mask their model call was handed shows some."""
    found, done = [], {}
    for call in run.calls:
        top = run.top(call)
        handed = None if top is None else top.arguments.get("handed_cells")
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        if handed is None or call.stored is None or q_len != k_len or q_len < 2:
            continue
        name, table = handed
        if table.shape[1:] != (q_len, k_len) or table.shape[0] not in (1, rows):
            continue
        key = (call.mask, tuple(call.shape), id(top))
        if key not in done:
            done[key] = _finding(call, name, table, rows, q_len)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call, name: str, table: np.ndarray, rows: int, length: int) -> Finding | None:
    read = _read(np.broadcast_to(table, (rows, length, length)))
    cells = keep(call)
    if read is None or cells is None or cells.shape[0] not in (1, rows):
        return None
    handed, real = read
    later = triu(handed, 1)  # (later keys the handed mask shows: none in a causal mask, asked first, as the cheapest)
    if not later.any():
        return None
    judged = real[:, :, None] & real[:, None, :] & (np.arange(length)[None, None, :] > np.arange(length)[None, :, None])
    shown, hidden = later & judged, ~handed & judged  # later real keys the handed mask shows, and hides
    if not shown.any() or not hidden.any():
        return None  # (no direction per query: causal, or both ways everywhere)
    seen = by_row(cells, rows)
    if (seen & judged).any():
        return None  # (the kernel sees later keys: not run causal)
    b, q, k = first_cell(shown)
    return Finding("handed-mask-made-causal", (
        f"batch row {b}: query {q} does not see the later key {k}, which the mask the model call was handed ({name}) "
        f"lets it see ({int(shown.sum())} such cells), while that mask keeps later keys from other queries: it states "
        "a direction per query (a prefix seen both ways), and this self-attention ran plain causal: the handed mask "
        "was dropped for the kernel's own causal one?"), expected=f"the cells of {name}", source=f"{name} of the model call",
        cell=(b, q, k))


RULES = (
    Rule("handed-mask-made-causal", "wrong", "call", "a model call handed a mask whose queries see later keys in part (a "
         "prefix LM's bidirectional prefix) whose self-attention runs plain causal: the handed mask dropped for a "
         "causal one (Megatron-DeepSpeed's prefix LM built with pretrain_causal_attention)", made_causal),
)
