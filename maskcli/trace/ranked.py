"""A top-k taken over attention scores along their keys: a sparse top-k attention's own statement of the keys it keeps.

Sparse top-k attention (x-transformers' Attend with `sparse_topk`, Explicit Sparse Transformer's `topk` per row) ranks
each query's scores with `scores.topk(k, dim=-1)` and keeps only the k best keys of each row. While the mode follows
scores (scores.py), a topk over them along their keys is noted: k, and the keys it picked in each query row, less
those not open when ranked (cells already masked: -inf, the dtype's lowest, a finite fill, as masks.softmax reads
them). The next softmax over scores of that shape carries them as details["topk"] = {"k", "picked"} (checks/topk.py
reads whether its mask is that top-k, kept or turned round: such a mask differs by head and by row on purpose, and
checks/heads.py and fewseen.py leave it alone).
A topk of the smallest scores (largest=False: a KNN graph filter's `topk(adj, k, largest=False)` scattered to 0, the
keys it drops) is noted too, "smallest": the keys it picked are those the mask drops. A topk of k that keeps every key
states no sparse mask: not noted.
"""

from __future__ import annotations

import torch

from maskcli.trace.finitefill import finite_fill

TOPS = {torch.topk, torch.Tensor.topk}
MOST_PICKS = 1 << 16  # indices kept at most (more: nothing noted)


class Ranked:
    """The last topk taken over scores along their keys, until a softmax over scores of its shape reads it."""

    def __init__(self):
        self.pending = None  # (the scores' shape, k, the keys each query row picked: (.., Lq, k), -1 where not open)

    def note(self, args: tuple, kwargs: dict, out, has) -> None:
        """At a topk call that made `out` (values, indices): noted where its input is scores (`has`: scores.py's
        Scores.has) ranked along their keys."""
        x = args[0] if args else kwargs.get("input", kwargs.get("self"))
        k = args[1] if len(args) > 1 else kwargs.get("k")
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
        if not isinstance(x, torch.Tensor) or not has(x) or x.dim() < 2 or not isinstance(k, int):
            return
        if dim not in (-1, x.dim() - 1) or not 0 < k < x.shape[-1] or not x.is_floating_point() \
                or x.numel() // x.shape[-1] * k > MOST_PICKS or not isinstance(out, tuple) or len(out) != 2:
            return
        with torch.no_grad():
            scores, picked = x.detach(), out[1].detach()
            lowest = torch.finfo(scores.dtype).min
            hidden = (scores == float("-inf")) | (scores == lowest) | finite_fill(scores, lowest, {})
            if largest:  # (a key already hidden is no pick; the smallest picks are the keys dropped, hidden ones too)
                picked = picked.masked_fill(hidden.gather(-1, picked), -1)
            self.pending = (tuple(scores.shape), int(k), picked, not largest)

    def of(self, x, call, seen) -> None:
        """At softmax `call` over scores `x`: details["topk"] where the topk just noted ranked scores of its shape."""
        pending, self.pending = self.pending, None
        if pending is None or not isinstance(x, torch.Tensor) or tuple(x.shape) != pending[0]:
            return
        _, k, picked, smallest = pending
        if picked.numel() != seen.shape[0] * seen.shape[1] * seen.shape[2] * k:
            return
        fact = {"k": k, "picked": picked.reshape(-1).tolist()}  # ((B, H, Lq, k))
        if smallest:
            fact["smallest"] = True
        call.details["topk"] = seen.details["topk"] = fact
