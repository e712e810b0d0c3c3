"""Scores multiplied by a 0/1 tensor before their softmax: the cells it zeroes, read at the softmax (checks/multiplied.py).

A keep mask multiplied into the scores (`dots *= mask`, `(a + b) * batch_mask`) sets the cells it leaves out to a
logit of 0, not -inf: the softmax still weighs them exp(0) against the kept ones (berniwal/swin-transformer-pytorch
ae5ae7b, graphormer-pyg f56d6487). While the scores are followed (trace/scores.py), a product of scores (or of a view of
them, written in place) with a tensor of only 0s and 1s, some of each (a KNN mask scattered into `zeros_like(scores)` is
followed as scores too: its values say it is a mask; TimeFilter#13), that broadcasts to them marks the cells it
zeroed on the scores' base tensor; an out-of-place step that keeps the shape (a scaling, a fill) carries the marks.
At a softmax over marked scores, "multiplied" says how many marked cells it still weighs (not filled low since: a
`masked_fill(mask == 0, -inf)` or a `(1 - mask) * -1e9` after the product masks them) in rows that weigh unmarked
cells too (a row zeroed whole is a padded query's, uniform whatever is done), less those the weights are then
multiplied by 0 at (`narrowed`: AllenNLP's masked_softmax multiplies its mask in both before and after the softmax).
"""

from __future__ import annotations

import weakref

import torch

from maskcli.trace.after import MULS

MOST = 1 << 24  # cells of scores marked at most
LOW = -1e4  # a logit at most this low is masked (a finite fill, -inf)


def _base(x: torch.Tensor) -> torch.Tensor:
    return x._base if x._base is not None else x


def _region(marks: torch.Tensor, base: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """The marks of view `x` of `base` (marks laid out as the contiguous base); None where `x` is no plain view of it."""
    if x is base:
        return marks
    if not base.is_contiguous():
        return None
    try:
        return marks.as_strided(x.size(), x.stride(), x.storage_offset() - base.storage_offset())
    except RuntimeError:
        return None


def _zero_one(other) -> torch.Tensor | None:
    """Where tensor `other` is 0, when it holds only 0s and 1s, some of each (bool, int or float); None otherwise."""
    if not isinstance(other, torch.Tensor) or other.dim() < 2 or other.numel() > MOST or other.device.type == "meta":
        return None
    with torch.no_grad():
        zeros = other == 0
        if not bool(zeros.any()) or bool(zeros.all()) or not bool((zeros | (other == 1)).all()):
            return None
    return zeros


class Products:
    """Base scores (by identity, a weak reference each) and the cells a 0/1 product zeroed in them."""

    def __init__(self):
        self.found: dict[int, tuple] = {}  # id(base) -> (a weak reference to it, bool marks of its shape)

    def _marks(self, x) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(base, marks) of a tensor that is (a view of) marked scores."""
        if not isinstance(x, torch.Tensor):
            return None
        base = _base(x)
        held = self.found.get(id(base))
        return (base, held[1]) if held is not None and held[0]() is base else None

    def after(self, func, args: tuple, out, has) -> None:
        """Note a 0/1 product of scores (`has`: trace/scores.py's), or carry marks to what keeps their shape."""
        if not isinstance(out, torch.Tensor) or out.numel() > MOST:
            return
        if func in MULS and len(args) >= 2:
            for scores, other in ((args[0], args[1]), (args[1], args[0])):
                # (a 0/1 mask made from the scores, `zeros_like(scores).scatter(-1, topk, 1)`, is followed as scores
                # too: its values, not its making, say it is a mask)
                if not (isinstance(scores, torch.Tensor) and has(scores)) or other is scores:
                    continue
                zeros = _zero_one(other)
                if zeros is not None:
                    break
            else:
                zeros = None
            if zeros is not None:
                try:
                    zeros = zeros.broadcast_to(out.shape)
                except RuntimeError:
                    return
                self._mark(out, zeros)
                return
        if self.found and _base(out) is out:  # (an out-of-place step of marked scores that keeps their shape)
            for x in args[:2]:
                held = self._marks(x)
                if held is not None and x is held[0] and x is not out and x.shape == out.shape:
                    self._keep(out, held[1].clone())
                    return

    def _mark(self, out: torch.Tensor, zeros: torch.Tensor) -> None:
        base = _base(out)
        held = self._marks(base)
        marks = held[1] if held is not None else torch.zeros(base.shape, dtype=torch.bool, device=base.device)
        region = _region(marks, base, out)
        if region is None:
            return
        region |= zeros
        self._keep(base, marks)

    def _keep(self, base: torch.Tensor, marks: torch.Tensor) -> None:
        if len(self.found) >= 64:
            self.found = {k: v for k, v in self.found.items() if v[0]() is not None}
        self.found[id(base)] = (weakref.ref(base), marks)

    def of(self, x, call, seen) -> None:
        """At softmax `call` over scores `x`: details["multiplied"] = {"cells", "rows"} where marked cells are still
        weighed in rows that weigh unmarked ones too."""
        held = self._marks(x)
        if held is None:
            return
        marks = _region(held[1], held[0], x)
        if marks is None or marks.shape != x.shape:
            return
        with torch.no_grad():
            weighed = x.detach() > LOW
            zeroed, kept = marks & weighed, ~marks & weighed
            rows = zeroed.any(-1) & kept.any(-1)
            if not bool(rows.any()):
                return
            seen.marked = zeroed & rows[..., None]
            cells = int(seen.marked.sum())
        call.details["multiplied"] = seen.details["multiplied"] = {"cells": cells, "rows": int(rows.sum())}

    def narrowed(self, call, seen, keep: torch.Tensor) -> None:
        """The call's weights masked after its softmax by `keep` (trace/after.py): the marked cells it hides weigh
        nothing after all (AllenNLP's masked_softmax: softmax(scores * mask) * mask, renormalised), so only those it
        keeps count; where none is left, "multiplied" goes."""
        marked = getattr(seen, "marked", None)
        if marked is None or "multiplied" not in seen.details:
            return
        try:  # (the scores' cells as the call's keep lays them out: (B, H, Lq, Lk), a 3-D softmax's rows folded)
            if marked.numel() == keep.numel():
                still = marked.reshape(keep.shape) & keep
            elif keep.dim() <= marked.dim():
                still = marked & keep
            else:
                return
        except RuntimeError:  # (shapes that do not broadcast: left as read)
            return
        rows = still.any(-1)
        for details in (call.details, seen.details):
            details.pop("multiplied", None)
            if bool(rows.any()):
                details["multiplied"] = {"cells": int(still.sum()), "rows": int(rows.sum())}
