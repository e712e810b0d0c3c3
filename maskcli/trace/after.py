"""A softmax's weights masked after it: multiplied by a 0/1 mask (AllenNLP's masked_softmax, then renormalised).

softmax(scores * mask) * mask, divided by its sum, gives the masked keys weight exactly 0 as a fill before the
softmax would: the softmax masks nothing, the product does. So the output of each recorded softmax is followed
(by identity, a weak reference: nothing kept alive) until a multiplication by a tensor of only 0s and 1s (or bools)
that broadcasts to it; the call's mask is then what the program computes, the softmax's keep and the multiplier's.

A masked_fill of those weights with 0 over every row that sees no key (WeNet's and ESPnet's
`softmax(scores).masked_fill(mask, 0.0)`) zeroes the NaN a softmax of all -inf gives there: the call records it
(details `zeroed_after`), so that no check says NaN of rows the program itself sets to 0. Where that fill is out of
place (`attn.masked_fill(rows, 0.)`, its result never bound) and the product with the values then reads the softmax's
own weights, the zeroing was lost (flamingo-pytorch 10913ab): the call records `zeroed_unused` (checks/softmaxed.py)
and no longer `zeroed_after`.

At each product a followed softmax output is the first operand of (weights @ v, einsum over the keys), the query rows
whose weights are all finite but whose output holds NaN are recorded (details `nan_values`: flat (b, h, q) indices):
the values carried NaN into rows that gave those keys weight 0 (vit-pytorch#26: the padding patches' NaN rows of the
layer before, read here as values; checks/nans.py).

The product's output is followed too where some query row saw no key: a masked_fill of it with 0 over every such
row (x-transformers' `out.masked_fill(row_is_entirely_masked[..., None], 0.)`, 35f7000), or a product of it with a
0/1 tensor that is 0 there, or a `where(isnan(out), 0, out)` or `nan_to_num` of it that is 0 there (BLT's padded
patches), sets those rows' output to 0 whatever the softmax gave them (details `zeroed_output`: checks/rows.py's what_api_does says so). Where the product
itself is 0 in every such row (the values they read are 0: MusicGen's classifier-free-guidance rows, zero states under
a bias-free projection), their uniform weights did no harm: `zeroed_output` is "values".

A fill of -inf (or a finite fill at most -1e4) written into those weights (NISQA's `att[~mask] = -inf` after
`softmax`) is a mask applied after the softmax: the softmax already gave those keys weight, and the weights now hold
-inf. The call records it (details `filled_after`: the fill and the cells), for checks/after.py to say.

A 0/1 product that leaves a real query row no key at all, where the softmax's own mask gave it keys (a causal head
mask built with tril(diagonal=-1): Transformers4Rec 3d94628), does not narrow the call's mask (the row would read as
a padding row's); it is recorded as details `emptied_after` (checks/softmaxed.py).

Once the weights were read by their product with the values, a 0/1 product of them is the program's own analysis
(maxjcohen/transformer's `attention_map * future_in_window`, its last query's row all 0), not a mask: not followed.
"""

from __future__ import annotations

import weakref

import torch

from maskcli.trace.followed import KEEP, follow, operands_of
from maskcli.trace.overqueries import summed

MULS = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.mul_, torch.Tensor.__mul__, torch.Tensor.__rmul__,
                  torch.Tensor.__imul__})
FILLS = frozenset({torch.masked_fill, torch.Tensor.masked_fill, torch.Tensor.masked_fill_})
COPIES = frozenset({torch.masked_fill, torch.Tensor.masked_fill})  # (out of place: the weights stay as they were)
PRODUCTS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm,
                      torch.einsum})
ZEROINGS = frozenset({torch.where, torch.Tensor.where, torch.nan_to_num, torch.Tensor.nan_to_num,
                      torch.Tensor.nan_to_num_})  # (an output's NaN rows set to 0: where(isnan(out), 0, out), nan_to_num)
WRITES = frozenset({torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.index_put_})  # (in place: the weights
# themselves hold the fill afterwards)
FILL_AT_MOST = -1e4  # (a fill: as trace/masks.py reads one in scores)


class After:
    """The recorded softmax outputs whose product with a 0/1 mask narrows their call's mask."""

    def __init__(self):
        self._found: dict[int, tuple] = {}
        self._copied: dict[int, tuple] = {}  # id(weights) -> (the rows an out-of-place fill zeroed in a copy, its op)
        self._read: set[int] = set()  # id(weights) already read by weights @ values: a product after it is no mask

    def note(self, out, call, seen) -> None:
        """Follow `out`, the weights of softmax `call` (read as `seen`)."""
        if not isinstance(out, torch.Tensor) or call.mask is None or "axes" in seen.details:
            return  # (weights in another axis order than their call's mask, layout.py: not followed)
        found = self._found
        if len(found) >= KEEP:
            found.clear()
        key = id(out)

        copied = self._copied
        copied.pop(key, None)  # (an id a dead output had, now this one's)
        self._read.discard(key)

        def gone(ref) -> None:
            if found.get(key, (None,))[0] is ref:
                del found[key]
                copied.pop(key, None)
                self._read.discard(key)

        try:
            found[key] = (weakref.ref(out, gone), call, seen)
        except TypeError:
            pass

    def after(self, trace, func, args: tuple, out=None) -> None:
        """On a multiplication of a followed softmax output by a 0/1 tensor: that call's mask narrowed to it."""
        if func in FILLS:
            self._output_filled(args)
            self._filled(trace, args, func in COPIES)
            return
        if func in PRODUCTS:
            self._product(func, args, out)
            return
        if func in WRITES:
            self._written(args)
            return
        if func in ZEROINGS:
            self._output_zeroed(func, args, out)
            return
        if func not in MULS or len(args) < 2:
            return
        for mine, other in ((args[0], args[1]), (args[1], args[0])):
            if isinstance(mine, torch.Tensor) and ("output", id(mine)) in self._found and isinstance(other, torch.Tensor):
                self._output_filled((mine, other == 0, 0))  # (output * keep: the rows it multiplies by 0, zeroed)
                return
            entry = self._found.get(id(mine)) if isinstance(mine, torch.Tensor) else None
            if entry is not None and entry[0]() is mine and isinstance(other, torch.Tensor) \
                    and id(mine) not in self._read:  # (weights the values already read: the program's own analysis)
                self._narrow(trace, mine, other, entry)
                return

    def _filled(self, trace, args: tuple, copy: bool = False) -> None:
        """masked_fill(weights, where, 0) of a followed softmax output: its rows with no key zeroed, if all covered; with
        a fill (-inf, at most -1e4) instead: a mask after the softmax (_record). `copy`: out of place (the rows it
        zeroes whole are remembered: a product that reads the weights themselves afterwards lost them, _product). A
        hand-written softmax's exp (details by_hand "exp") filled with 0 in rows that keep keys is masked (_narrowed)."""
        if len(args) < 3 or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], torch.Tensor):
            return
        entry = self._found.get(id(args[0]))
        value = _number(args[2])
        if entry is None or entry[0]() is not args[0] or value is None:
            return
        _, call, seen = entry
        if value <= FILL_AT_MOST:
            with torch.no_grad():
                try:
                    where = args[1].to(torch.bool).broadcast_to(args[0].shape)
                except RuntimeError:
                    return
            _record(call, seen, where, value)
            return
        if value != 0:
            return
        with torch.no_grad():
            try:
                where = args[1].to(torch.bool).broadcast_to(args[0].shape).reshape(seen.keep.shape)
            except RuntimeError:
                return
            if copy:
                whole = where.all(dim=-1)  # (.., Lq): rows the copy zeroes whole
                if bool(whole.any()):
                    if len(self._copied) >= KEEP:
                        self._copied.clear()
                    self._copied[id(args[0])] = (whole.reshape(-1).nonzero().flatten().tolist()[:4096], "masked_fill")
            empty = ~seen.keep.any(dim=-1)  # (.., Lq): the rows a softmax of all -inf makes NaN
            if bool(empty.any()) and bool(where[empty].all()):
                call.details["zeroed_after"] = True
                seen.details["zeroed_after"] = True
            keep = seen.keep & ~where
            if seen.details.get("by_hand") != "exp" or bool((keep == seen.keep).all()) \
                    or not bool((keep.any(dim=-1) | empty).all()):
                return  # (a softmax's weights zeroed are not renormalised by it; a row left no key is no mask meant)
        self._narrowed(trace, args[0], keep, entry, "filled with 0 after exp, before the sum that normalises it")

    def _product(self, func, args: tuple, out) -> None:
        """weights @ values of a followed softmax output: rows the values turned NaN (`nan_values`), and rows an
        out-of-place masked_fill zeroed in a copy the product does not read (`zeroed_unused`)."""
        operands = operands_of(func, args)
        if not operands or not isinstance(operands[0], torch.Tensor):
            return
        weights = operands[0]
        entry = self._found.get(id(weights))
        if entry is None or entry[0]() is not weights:
            return
        _, call, seen = entry
        if len(self._read) >= KEEP:
            self._read.clear()
        self._read.add(id(weights))
        over = call.details.get("over_queries")
        if over is not None and "summed" not in over:  # (a softmax over the queries: its keys summed, overqueries.py)
            how = summed(func, args, weights)
            if how is not None:
                over["summed"] = how
        copied = self._copied.pop(id(weights), None)
        if copied is not None:
            rows, how = copied
            lost = {"rows": rows, "cells": len(rows), "by": how}
            for details in (call.details, seen.details):
                details["zeroed_unused"] = lost
                details.pop("zeroed_after", None)
        if isinstance(out, torch.Tensor) and out.requires_grad and call.details.get("nan_rows") \
                and "nan_backward" not in call.details and len(operands) > 1:
            _backward(out, operands[1], weights, call, seen)
        if not isinstance(out, torch.Tensor) or tuple(out.shape[:-1]) != tuple(weights.shape[:-1]) \
                or not weights.is_floating_point() or weights.numel() != seen.keep.numel():
            return
        with torch.no_grad():
            empty = ~seen.keep.any(dim=-1)  # (.., Lq): rows that see no key
            if bool(empty.any()):
                if _zero_where(out, empty):  # (the values they read are 0: MusicGen's classifier-free-guidance rows,
                    # zero states under a bias-free projection, whose uniform weights give 0 as a fill of 0 would)
                    call.details["zeroed_output"] = seen.details["zeroed_output"] = "values"
                self._follow_output(out, call, seen, empty)
            nan = torch.isnan(out).any(dim=-1)  # (.., Lq): the weights read only where the output has NaN at all
            if not bool(nan.any()):
                return
            bad = nan & torch.isfinite(weights).all(dim=-1)
            if bool(bad.any()):
                flat = bad.reshape(-1).nonzero().flatten().tolist()[:4096]
                call.details["nan_values"] = seen.details["nan_values"] = flat

    def _follow_output(self, out: torch.Tensor, call, seen, empty: torch.Tensor) -> None:
        """Follow `out`, weights @ v of a softmax whose `empty` rows see no key, for a fill of 0 over those rows (kept
        beside the weights, under ("output", id): the tracer follows products and fills while either is alive)."""
        follow(self._found, ("output", id(out)), out, call, seen, empty)

    def _output_filled(self, args: tuple) -> None:
        """masked_fill(output, where, 0) of a followed product over every row its softmax left no key: zeroed_output."""
        if len(args) < 3 or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], torch.Tensor):
            return
        entry = self._found.get(("output", id(args[0])))
        if entry is None or entry[0]() is not args[0] or _number(args[2]) != 0:
            return
        _, call, seen, empty = entry
        with torch.no_grad():
            try:
                where = args[1].to(torch.bool).broadcast_to(args[0].shape).all(dim=-1).reshape(empty.shape)
            except RuntimeError:
                return
            if bool(where[empty].all()):
                call.details["zeroed_output"] = seen.details["zeroed_output"] = True

    def _output_zeroed(self, func, args: tuple, out) -> None:
        """where(isnan(output), 0, output) or nan_to_num(output) of a followed product (BLT's padded patch rows) whose
        result is 0 in every row its softmax left no key: those NaN rows zeroed (zeroed_output), as a masked_fill is."""
        operands = args[1:3] if func is torch.where else args[:1] if func is not torch.Tensor.where else args[:3:2]
        for operand in operands:
            entry = self._found.get(id(operand)) if isinstance(operand, torch.Tensor) else None
            if entry is not None and entry[0]() is operand:  # (the weights themselves: onnxscript's Softmax lowering)
                self._weights_zeroed(operand, operand if out is None else out, entry)
                return
            entry = self._found.get(("output", id(operand))) if isinstance(operand, torch.Tensor) else None
            if entry is None or entry[0]() is not operand:
                continue
            _, call, seen, empty = entry
            result = operand if out is None else out  # (nan_to_num_ in place: the output itself)
            if isinstance(result, torch.Tensor) and result.shape == operand.shape:
                with torch.no_grad():
                    if _zero_where(result, empty):
                        call.details["zeroed_output"] = seen.details["zeroed_output"] = True
            return

    def _weights_zeroed(self, weights: torch.Tensor, result, entry: tuple) -> None:
        """where(isnan(weights), 0, weights) or nan_to_num(weights) of a followed softmax output (onnxscript ecb7677's
        `Where(IsNaN(attn_weight), 0, attn_weight)` after its Softmax) whose result is 0 in every row the softmax left
        no key: those NaN rows zeroed (zeroed_after), as a masked_fill with 0 zeroes them. Out of place, the rows are
        remembered as a masked_fill's copy is: a product that reads the weights themselves afterwards lost them."""
        _, call, seen = entry
        if not isinstance(result, torch.Tensor) or result.shape != weights.shape or result.numel() != seen.keep.numel() \
                or not result.is_floating_point():
            return
        with torch.no_grad():
            empty = ~seen.keep.any(dim=-1)  # (.., Lq): the rows a softmax of all -inf makes NaN
            if not bool(empty.any()) or not bool((result.reshape(seen.keep.shape)[empty] == 0).all()):
                return
            call.details["zeroed_after"] = seen.details["zeroed_after"] = True
            if result is not weights:
                if len(self._copied) >= KEEP:
                    self._copied.clear()
                rows = empty.reshape(-1).nonzero().flatten().tolist()[:4096]
                self._copied[id(weights)] = (rows, "where / nan_to_num")

    def _narrow(self, trace, out: torch.Tensor, other: torch.Tensor, entry: tuple) -> None:
        _, call, seen = entry
        with torch.no_grad():
            if other.dim() > out.dim() or not (other.dtype == torch.bool or bool(((other == 0) | (other == 1)).all())):
                return
            try:
                zero = (other == 0).broadcast_to(out.shape)
            except RuntimeError:
                return
            if not bool(zero.any()) or zero.numel() != seen.keep.numel():
                return
            zero = zero.reshape(seen.keep.shape)
            empty = ~seen.keep.any(dim=-1)  # (.., Lq): the rows the softmax gave no key (uniform weights, or NaN)
            if bool(empty.any()) and bool(zero[empty].all()):  # (d2l's `X * (valid_lens > 0)`: those rows' weights 0)
                call.details["zeroed_after"] = seen.details["zeroed_after"] = True
            keep = seen.keep & ~zero
            if not bool(keep.any(dim=-1).all()):
                _emptied(call, seen, keep, zero)  # (a real query left no key: checks/softmaxed.py's emptied-after-softmax)
                return  # (a row left with no key: renormalising it is 0 / 0, not a mask the program meant)
        self._narrowed(trace, out, keep, entry, "multiplied by a 0/1 mask after the softmax")

    def _narrowed(self, trace, out: torch.Tensor, keep: torch.Tensor, entry: tuple, how: str) -> None:
        """The call of `entry` (its weights `out`) masked by `keep`, as the program computes it (`how`, in words). (A
        hand-written softmax's exp filled with 0 before its sum, `attn.masked_fill(mask, 0) / attn.sum(-1)`, is one:
        Practical_NLP_in_PyTorch's ScaledDotProductAttention.)"""
        _, call, seen = entry
        trace.products.narrowed(call, seen, keep)  # (a 0/1 mask multiplied into the scores too: trace/multiplied.py)
        seen.keep = keep
        q_len = keep.shape[-2]
        if q_len > 1 and bool((keep == keep[..., :1, :]).all()):
            seen.details["mask_rows"] = 1
        seen.details["masked_after"] = how
        from maskcli.trace.given import stored

        trace.busy = True
        try:
            call.mask = stored(trace, seen)
            trace._late.append(call)  # (its key may be a placeholder: Trace.calls replaces it)
            call.details.update(seen.details)
        finally:
            trace.busy = False
        del self._found[id(out)]


    def _written(self, args: tuple) -> None:
        """weights[index] = fill (or index_put_) of a followed softmax output, in place: a mask after the softmax."""
        if len(args) < 3 or not isinstance(args[0], torch.Tensor):
            return
        entry = self._found.get(id(args[0]))
        value = _number(args[2])
        if entry is None or entry[0]() is not args[0] or value is None or value > FILL_AT_MOST:
            return
        with torch.no_grad():
            where = args[0] == value if value == float("-inf") else args[0] <= FILL_AT_MOST
        _record(entry[1], entry[2], where, value)


def _backward(out: torch.Tensor, values, weights: torch.Tensor, call, seen) -> None:
    """Weights whose rows are NaN (a softmax of all -inf, not zeroed) multiplied by values autograd records: a hook on
    the product records on the call, once the backward pass reaches it, `nan_backward` (the NaN rows' count), since the
    values' gradient is then weightsᵀ @ grad, NaN × 0 = NaN wherever those rows are, whatever the program does with
    their outputs (dgl#2657: the padded node rows' outputs dropped, the model's gradients NaN; checks/nans.py)."""
    if not isinstance(values, torch.Tensor) or not values.requires_grad:
        return
    with torch.no_grad():
        rows = int(torch.isnan(weights).all(dim=-1).sum())
    if not rows:
        return
    details = (call.details, seen.details)
    for one in details:
        one["nan_backward"] = None  # (followed: set once the backward pass reaches the product)

    def reached(grad):
        for one in details:
            one["nan_backward"] = rows
        return None

    try:
        out.register_hook(reached)
    except RuntimeError:
        pass


def _zero_where(out: torch.Tensor, empty: torch.Tensor) -> bool:
    """Whether every output row of weights @ v at the `empty` rows (those that see no key) is exactly 0."""
    if empty.numel() * out.shape[-1] != out.numel() or not out.is_floating_point():
        return False
    return bool((out.reshape(-1, out.shape[-1])[empty.reshape(-1)] == 0).all())


def _number(value) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _record(call, seen, where: torch.Tensor, value: float) -> None:
    """A fill written into softmax weights at `where` (bool, the weights' shape): recorded on the call."""
    cells = int(where.sum())
    if not cells:
        return
    rows = where.reshape(where.shape[0], -1).any(dim=-1).nonzero().flatten().tolist() if where.dim() else []
    filled = {"value": "-inf" if value == float("-inf") else f"{value:g}", "cells": cells, "rows": rows}
    call.details["filled_after"] = filled
    seen.details["filled_after"] = filled


def _emptied(call, seen, keep: torch.Tensor, zero: torch.Tensor) -> None:
    """The query rows a 0/1 product after the softmax leaves with no key where the softmax's own mask gave them some,
    whose own token's key (position q + Lk - Lq) another query of the row still sees (a real token, not padding),
    in a head whose other rows keep keys (not a head pruned whole): recorded as details `emptied_after` (the first
    (b, h, q), how many, the keys the first lost, and `query_mask`: the product's 0s are whole query rows, a query
    padding mask, which calls padding a token the key mask before the softmax keeps real)."""
    q_len, k_len = keep.shape[-2:]
    if q_len > k_len:
        return
    had = seen.keep  # (the same shape: _narrow's product covers the weights)
    emptied = had.any(dim=-1) & ~keep.any(dim=-1)  # (B, H, Lq)
    own = torch.arange(q_len, device=keep.device) + (k_len - q_len)
    real = keep.any(dim=-2)[..., own]  # (B, H, Lq): the query's own key, seen by some query after the product
    bad = emptied & real & ~emptied.all(dim=-1, keepdim=True)
    if not bool(bad.any()):
        return
    b, h, q = (int(x) for x in bad.nonzero()[0])
    lost = had[b, h, q].nonzero().flatten().tolist()[:64]
    found = {"cell": [b, h, q], "rows": int(bad.sum()), "lost": lost, "own": int(own[q]),
             "query_mask": bool((zero == zero[..., :1]).all()) and int(own[q]) in lost}
    call.details["emptied_after"] = seen.details["emptied_after"] = found
