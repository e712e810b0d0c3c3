"""tree: the draft tokens of tree speculative decoding (Medusa, EAGLE, SpecInfer).

Draft token i sits at absolute position q_start + i, after the cached prefix 0..q_start-1;
`parents[i]` is the index of its parent among the draft tokens, -1 for a root. A draft
token sees the whole prefix, its ancestors and itself.
"""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError
from maskcli.intervals import MAX_PER_ROW, Intervals, NotFew
from maskcli.kinds.base import Kind, Param

MAX_DRAFT = 1 << 16


def _parents(p) -> np.ndarray:
    return p["parents"].array[0]


def ancestor_runs(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per draft token, its ancestors and itself as runs [start, end) of draft indices, (n, K) each.

    A run ends where a token's parent is not the token just before it; following the
    parent of each run's first token gives the next run, so the loop runs once per run
    (a chain of any length is one run), vectorised over every token.
    """
    n = len(parents)
    index = np.arange(n)
    breaks = parents != index - 1
    breaks[0] = True
    run_start = np.maximum.accumulate(np.where(breaks, index, 0))
    starts, ends = [], []
    current = index.copy()
    while (current >= 0).any():
        if len(starts) == MAX_PER_ROW:
            raise NotFew(f"tree: a draft token's ancestors fall in more than {MAX_PER_ROW} separate runs")
        alive = current >= 0
        first = np.where(alive, run_start[np.maximum(current, 0)], 0)
        starts.append(np.where(alive, first, 0))
        ends.append(np.where(alive, current + 1, 0))
        current = np.where(alive, parents[first], -1)
    return np.stack(starts, axis=1), np.stack(ends, axis=1)


def _intervals(p, frame):
    starts, ends = ancestor_runs(_parents(p))
    prefix = Intervals.of(frame.k_start, frame.q_start, frame.k_start, frame.k_end)
    drafted = Intervals.of(starts[None] + frame.q_start, ends[None] + frame.q_start, frame.k_start, frame.k_end)
    return prefix | drafted


DENSE_DRAFT = 1 << 13  # a tree whose ancestor lines are not a few runs is a dense table up to this many drafts


def ancestor_table(parents: np.ndarray) -> np.ndarray:
    """bool (n, n): row i is True at draft i and its ancestors (a parent comes before its child)."""
    n = len(parents)
    table = np.zeros((n, n), dtype=bool)
    for i, parent in enumerate(parents.tolist()):  # bounded by DENSE_DRAFT; only for trees of many runs
        if parent >= 0:
            table[i] = table[parent]
        table[i, i] = True
    return table


def _predicate(p, frame, device):
    import torch

    parents = _parents(p)
    first, count = frame.q_start, len(parents)
    try:
        runs = ancestor_runs(parents)
    except NotFew as reason:
        if count > DENSE_DRAFT:
            raise MaskError(f"{reason}, and with {count:,} draft tokens (more than {DENSE_DRAFT:,}) maskcli cannot draw it") from None
        table = torch.as_tensor(ancestor_table(parents), device=device)

        def tree_dense(b, h, q_idx, kv_idx):
            token = (q_idx - first).clamp(0, count - 1)
            draft = kv_idx - first
            own_line = table[token, draft.clamp(0, count - 1)] & (draft >= 0) & (draft < count)
            return (kv_idx < first) | own_line

        return tree_dense
    starts, ends = (torch.as_tensor(a, device=device) for a in runs)

    def tree(b, h, q_idx, kv_idx):
        token = (q_idx - first).clamp(0, count - 1)  # clamped: kernels may call past the last block's end
        draft = (kv_idx - first)[..., None]
        own_line = ((draft >= starts[token]) & (draft < ends[token])).any(-1)
        return (kv_idx < first) | own_line

    return tree


def _why(p, frame, b, q, kv):
    first, parents = frame.q_start, _parents(p)
    if kv < first:
        return True, f"kv {kv} < {first}: in the cached prefix"
    token, draft = q - first, kv - first
    line = [token]
    while parents[line[-1]] >= 0 and len(line) <= len(parents):  # a parent comes before its child: this ends
        line.append(int(parents[line[-1]]))
    shown = " <- ".join(map(str, line[:8])) + (" <- ..." if len(line) > 8 else "")
    where = f"q {q} is draft {token}, its line (itself <- ancestors) {shown}"
    if draft >= len(parents):
        return False, f"{where}; kv {kv} is past the drafts"
    return (draft in line), f"{where}; kv {kv} is draft {draft}, {'on' if draft in line else 'not on'} it"


def _check(p, frame, where):
    parents = _parents(p)
    if p["parents"].rows != 1:
        raise MaskError(f"{where}: a tree takes one row of parents, shared by every batch row")
    if len(parents) > MAX_DRAFT:
        raise MaskError(f"{where}: {len(parents):,} draft tokens is more than maskcli draws ({MAX_DRAFT:,})")
    bad = (parents != -1) & ((parents < 0) | (parents >= np.arange(len(parents))))
    if bad.any():
        i = int(bad.nonzero()[0][0])
        if i == 0:
            raise MaskError(f"{where}: parents[0] is {int(parents[0])}; the first draft token has no earlier one, so its parent is -1 (a root)")
        raise MaskError(
            f"{where}: parents[{i}] is {int(parents[i])}; each parent is -1 (a root) or an earlier draft token "
            f"(0 to {i - 1}), as draft trees are laid out"
        )


KINDS = (
    Kind(
        name="tree",
        meaning="speculative decoding: each draft token sees the cached prefix, its ancestors and itself",
        keep="kv < q_start, or kv is q or an ancestor of q",
        params=(Param("parents", "labels", "per draft token, the index of its parent among the draft tokens (-1 = root)", "--parents", metavar="PARENTS"),),
        example="tree(-1,0,0,1)",
        options="--offset 4",
        intervals=_intervals,
        predicate=_predicate,
        why=_why,
        rank=30,
        check=_check,
        queries=lambda p: p["parents"].length,
        causal=True,
        sees_own=True,
    ),
)
