"""Tokens routed out of each row by a gather: the positions taken, kept as permuted.py keeps a reordering (checks/routed.py).

A routing block (Mixture-of-Depths, a top-k token selection) takes k of each row's L tokens with a `gather` along
axis 1 of a (B, L, ...) tensor, one index per (row, token) broadcast over the trailing axes, and attends over those k
tokens alone. The index holds the positions the tokens came from, and their order is the order the attention sees
them in (sramshetty/mixture-of-depths#5: `argsort(topk_indices)`, a permutation of 0..k-1, gathered in place of the
sorted positions). Kept for the outermost module call running, as trace/permuted.py keeps its permutations (the same
store, an entry with "positions" in place of "rows"). Cheap: shapes first, an index read only for a gather of that form.
"""

from __future__ import annotations

import torch

CELLS = 1 << 16  # (B, k) positions of an index read at most


def subset(args: tuple, kwargs: dict):
    """((B, k) int64 numpy positions, L) a gather takes along axis 1 of its (B, L, ...) input: 2 <= k < L tokens of
    each row, taken whole (one index per token, broadcast over the trailing axes), distinct within each row; else None."""
    given = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    index = args[2] if len(args) > 2 else kwargs.get("index")
    if type(given) is not torch.Tensor or type(index) is not torch.Tensor or not isinstance(dim, int):
        return None
    if given.dim() < 3 or index.dim() != given.dim() or dim % given.dim() != 1 or index.shape[0] != given.shape[0] \
            or index.shape[2:] != given.shape[2:]:
        return None
    rows, taken, length = int(index.shape[0]), int(index.shape[1]), int(given.shape[1])
    if not 2 <= taken < length or rows * taken > CELLS or index.dtype not in (torch.int64, torch.int32):
        return None
    with torch._C.DisableTorchFunction(), torch.no_grad():
        first = whole(index, rows, taken)
        if first is None:
            return None
        ordered = first.sort(dim=1).values
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
            return None  # (a token taken twice: no routing of distinct tokens)
        return first.cpu().numpy().astype("int64"), length


def whole(index: torch.Tensor, rows: int, taken: int):
    """The (rows, taken) positions of a gather's index that holds one position per (row, token), broadcast over the
    trailing axes (each token taken whole); None where features are gathered from positions of their own."""
    flat = index.reshape(rows, taken, -1)
    first = flat[..., 0]
    return first if bool((flat == first[..., None]).all()) else None
