"""A softmax over the query axis of scores whose fill masks the same keys in every query row: the mask cancels.

A key padding mask laid on the scores (an additive -1e9 bias, (B, 1, Lk), or masked_fill with a finite fill) hides a key
only from a softmax over the keys. A softmax over the queries (dim -2) normalises each key's column apart: a fill the
same in every query row of a column shifts the whole column by one constant, which the softmax takes out again, so each
padded key keeps weight (its column sums to one over the queries) and the values' product then sums it into every
query's output (pyg-team/pytorch_geometric#6343: the old GraphMultisetTransformer's MAB added to_dense_batch's -1e9
bias to its (B*H, seeds, nodes) scores and took `torch.softmax(mask + score, 1)`, over the seeds; each seed attended the
zero-padded nodes of the smaller graphs).

Read only at a softmax over dim -2 of 3-D or 4-D scores a q @ kᵀ made (scores.py), in their plain axis order (follow.py
asks `wanted` first: nothing is read of any other softmax); recorded as one call whose every cell keeps weight, with
the padded key runs the fill states in `details["over_queries"]` (checks/overqueries.py says it). Not read: a fill of
-inf (a column all -inf is NaN, not cancelled), a fill that varies along the queries (a causal mask, or LoFTR's dual
softmax over two paddings: only part of it cancels). The product that reads the weights themselves and sums their key
axis (weights @ values, an einsum) is noted by after.py (`summed`): the program's statement that each query pools its
keys with these weights. A 0/1 mask multiplied into the weights afterwards narrows the call's mask as after.py does
for any softmax (Slot Attention's padded inputs zeroed after its softmax over the slots).
"""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.finitefill import FILL_AT_MOST
from maskcli.trace.followed import operands_of
from maskcli.trace.masks import Seen, _dtype, softmax_input

RUNS_MOST = 4096  # padded key runs kept at most


def wanted(x, args: tuple, kwargs: dict) -> bool:
    """A softmax over dim -2 of 3-D or 4-D float scores (a cheap test of the arguments, nothing of the tensor read)."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4) or not isinstance(dim, int) or isinstance(dim, bool):
        return False
    return -x.dim() <= dim < x.dim() and dim % x.dim() == x.dim() - 2 and x.is_floating_point()


def read(args: tuple, kwargs: dict) -> Seen | None:
    """The call of a softmax over the queries whose finite fill masks whole key columns, the same in every query row
    and leaving each row some key; None where the scores hold no such fill."""
    x = softmax_input(args, kwargs)
    with torch.no_grad():
        scores = x.detach()
        if bool(torch.isneginf(scores).any()):
            return None  # (a column all -inf is NaN: another bug, said where the weights turn NaN)
        masked = scores <= FILL_AT_MOST
        if not bool(masked.any()):
            return None
        pads = masked[..., 0, :]  # (.., Lk): the keys the first query row's fill hides
        if not bool((masked == pads.unsqueeze(-2)).all()):
            return None  # (the fill varies along the queries: not one constant per key column)
        rows = pads.any(dim=-1) & ~pads.all(dim=-1)
        if not bool(rows.any()):
            return None
        flat = pads.reshape(-1, pads.shape[-1]).cpu().numpy()
    edges = np.diff(np.pad(flat.astype(np.int8), ((0, 0), (1, 1))), axis=1)
    starts, ends = np.argwhere(edges == 1), np.argwhere(edges == -1)  # (row-major: paired in order)
    real = ~flat.all(axis=1)
    runs = [(int(s[0]), int(s[1]), int(e[1])) for s, e in zip(starts[:RUNS_MOST], ends[:RUNS_MOST]) if real[s[0]]]
    q_len, k_len = int(x.shape[-2]), int(x.shape[-1])
    shape = (int(x.shape[0]), int(x.shape[1]) if x.dim() == 4 else 1, q_len, k_len)
    over = {"dim": x.dim() - 2, "rank": x.dim(), "runs": runs, "rows": int(rows.sum()), "keys": int(flat[real].sum()),
            "fill": float(scores[masked].max())}
    seen = Seen("softmax", shape, tuple(int(n) for n in x.shape), (), (), _dtype(x), str(x.device),
                details={"fill": None, "over_queries": over})
    seen.keep = torch.ones((1, 1, 1, 1), dtype=torch.bool).expand(shape)  # (every cell keeps weight: the fill cancelled)
    return seen


read.api = "softmax"


def summed(func, args: tuple, weights: torch.Tensor) -> str | None:
    """How a product of the weights themselves (the first operand) sums their key axis and keeps their query axis:
    "a matmul" (weights @ values), "einsum '...'", or None."""
    if func is not torch.einsum:
        return "a matmul (weights @ values)"
    equation = args[0].replace(" ", "") if args and isinstance(args[0], str) else ""
    if "->" not in equation or "." in equation:
        return None
    inputs, output = equation.split("->")
    letters = inputs.split(",")
    operands = operands_of(func, args)
    if len(letters) < 2 or len(letters) != len(operands) or len(letters[0]) != weights.dim():
        return None
    key, query, others = letters[0][-1], letters[0][-2], set("".join(letters[1:]))
    return f"einsum '{args[0]}'" if key not in output and key in others and query in output else None
