"""A document of the mask whose position ids do not count one per token, while another of the same batch row does.

The model call's `position_ids` (2-D, or the multimodal rope rows (C, B, L) trace/tops.py keeps apart: Qwen2-VL's t, h,
w) give each token its place; the kernel's mask gives each real query its document: the keys it sees, when they are
exactly a run [s, q] that ends at itself (causal inside the document, nothing of another). Where one document of a
batch row counts its positions on one per token (text: every row of the ids + 1 from one token to the next) and another
document of the row steps by one other constant amount from token to token (0: every token at the same place; 2, 3:
a token counted as many times as its segment's number), both over three tokens or more, the ids were read off
something that is not the document's own tokens: a packed mask of segment ids 1, 2, 3 read as a 0/1 padding mask
(hiyouga/LlamaFactory#7754: Qwen2-VL's `get_rope_index` kept only the tokens where the mask == 1, so each later packed
sequence stayed at the ones it was filled with; `cumsum(attention_mask) - 1` over the same mask counts by the segment id).

Read on square self-attention calls from position 0 whose keys are the ids' tokens. Left alone: a query that sees a
later key (no causal document: HF's unmasked padding rows, an encoder), one that does not see itself (padding), an
image's tokens (their (t, h, w) ids differ from token to token, however the largest of them steps), a run of image
tokens that share one 1-D id (CogVLM's: inside a document that also counts, so its steps are not constant), a run of
zeros (a collator's padding, which a varlen kernel may attend as a sequence of its own: open-instruct's DPO fold), and
a row in which no document counts one per token (nothing states what a step is).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep, queries
from maskcli.checks.registry import Rule
from maskcli.text import Finding

LEAST = 3  # tokens of a document before its steps say anything


def _ids(arguments: dict) -> np.ndarray | None:
    """(C, B, L) position ids of the model call: its 2-D position_ids as one row, or its multimodal rope rows."""
    positions = arguments.get("position_ids")
    if isinstance(positions, np.ndarray) and positions.ndim == 2:
        return positions[None].astype(np.int64)
    rope = arguments.get("mrope_position_ids")
    if isinstance(rope, np.ndarray) and rope.ndim == 3 and rope.shape[0] in (3, 4):
        return rope.astype(np.int64)
    return None


def documents(seen: np.ndarray) -> list[tuple[int, int]]:
    """The documents [s, e] of one batch row's (L, L) kept cells: the queries s .. e, each of which sees exactly the
    keys from s to itself (query s only itself)."""
    n = seen.shape[0]
    q = np.arange(n)
    first = seen.argmax(axis=1)
    causal = seen[q, q] & ~np.triu(seen, 1).any(axis=1) & (seen.sum(axis=1) == q - first + 1)
    runs = []
    for s in np.unique(first[causal]).tolist():
        members = np.flatnonzero(causal & (first == s))
        if members[0] == s and members[-1] - s + 1 == members.size:
            runs.append((s, int(members[-1])))
    return runs


def step(ids: np.ndarray, s: int, e: int) -> int | None:
    """The one amount every row of the ids (C, L) steps by from token to token over [s, e]; None where they differ, and
    for a run of zeros (a collator's padding, attended as a sequence of its own by a varlen kernel: docrows.counted)."""
    diffs = np.diff(ids[:, s: e + 1], axis=1)
    if e - s + 1 < LEAST or diffs.size == 0 or not (diffs == diffs.flat[0]).all() or not ids[:, s: e + 1].any():
        return None
    return int(diffs.flat[0])


def stalled(run: Run) -> list:
    """A causal document of the mask whose position ids step by a constant other than 1 while another's step by 1."""
    found, done = [], set()
    for call in run.calls:
        top = run.top(call)
        ids = None if top is None else _ids(top.arguments)
        if ids is None or call.stored is None or call.shape[2] != call.shape[3] or ids.shape[2] != call.shape[3] \
                or cross(call) or queries(call, top)[0] != 0:
            continue
        cells, rows, key = keep(call), call.shape[0], (call.mask, call.shape, ids.tobytes())
        if key in done or cells is None or cells.shape[0] not in (1, rows) or ids.shape[1] not in (1, rows):
            continue  # (read once per mask; a call of other rows than the model call's: a varlen kernel's sequence)
        done.add(key)
        seen = np.broadcast_to(cells.any(axis=1), (rows, *cells.shape[2:]))
        ids = np.broadcast_to(ids, (ids.shape[0], rows, ids.shape[2]))
        steps = [[(s, e, step(ids[:, b], s, e)) for s, e in documents(seen[b])] for b in range(rows)]
        off = [(b, s, e, d) for b in range(rows) for s, e, d in steps[b] if d is not None and d != 1
               and any(one == 1 for _, _, one in steps[b])]
        if not off:
            continue
        b, s, e, d = off[0]
        cs, ce = next((s, e) for s, e, one in steps[b] if one == 1)
        at = ids[:, b, s].tolist()
        found.append((call, Finding("positions-stalled", (
            f"batch row {b}: the document at tokens {s}-{e} (each query sees the keys from {s} to itself) has position "
            f"ids that {'stay at ' + str(at if len(at) > 1 else at[0]) if d == 0 else f'step by {d} per token'}, "
            f"while the document at tokens {cs}-{ce} of the same row counts one per token "
            f"({len(off)} document{'s' if len(off) > 1 else ''} so): its ids were read off something other than its "
            f"own tokens (a mask of segment ids read as 0/1?)"),
            expected="position ids that count one per token in each document",
            source=f"position_ids of {top.where}", cell=(b, s + 1, s))))
    return found


RULES = (
    Rule("positions-stalled", "wrong", "steps", "a causal document of the mask whose position ids step by a "
         "constant other than one per token (stalled, or counted by a segment id) while another document of the "
         "same batch row counts one per token", stalled),
)
