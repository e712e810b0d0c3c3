"""Fills that overflow to -inf while a traced program computes: a cast or a sum that turns finite values into -inf.

A program fills masked scores with a finite value so that a row masked everywhere stays finite (uniform
weights, not NaN): torch.finfo(dtype).min, -1e9, -1e10. Two ways turn it into -inf again: a cast to a
narrower dtype (-1e10 or finfo(float32).min cast to float16, finfo(float32).min to bfloat16), and a sum
past the dtype's range (finfo.min + finfo.min, a causal plane added to a padding plane; finfo(float16).min
plus a score below -16). The trace watches the casts and the sums, subtractions and products the program
runs (never the in-place ones for an overflow: their operands are gone once they have run) and remembers, by
identity as scores.py does, every tensor where one made -inf out of finite values, and every tensor computed from one
that keeps its last two dimensions (a view, the scores it is added to, a where). An attention call given one
carries details["overflow"]: what overflowed, in which dtype, on which line of the program.

The same watch sees a bool mask added to the scores (scores.py's), out of place or in place (`scores += mask`,
DiffMS's MIST encoder: the bool is no operand an in-place add overwrites): the bool counts as 0 and 1, so it masks
nothing and adds 1 to the cells it keeps (or to those it meant to mask). A softmax over such scores carries
details["bool_added"], with the line that added it.
"""

from __future__ import annotations

import functools
import math
import weakref

import torch

from maskcli.trace.sites import frames_outside

SUMS = {torch.add, torch.Tensor.add, torch.Tensor.__radd__, torch.sub, torch.Tensor.sub, torch.Tensor.__rsub__,
        torch.mul, torch.Tensor.mul, torch.Tensor.__rmul__}
CASTS = {torch.Tensor.to, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.type, torch.Tensor.type_as}
ADDS = {torch.add, torch.Tensor.add, torch.Tensor.__radd__}
PRODUCTS = {torch.mul, torch.Tensor.mul, torch.Tensor.__rmul__}  # (read at import, as SUMS: while tracing, torch's
# attributes are the trace's wrappers, and the mode is handed the functions torch defines)
WATCHED = SUMS | CASTS
BOOL_FILLS = {torch.Tensor.masked_fill, torch.Tensor.masked_fill_}  # (a fill into a bool: mmdet#12351's -9e15 became True)
IN_PLACE = {torch.Tensor.add_}  # `scores += mask`: looked at while scores are followed, for a bool added only
KEEP = 256  # live tensors remembered at most (more: all forgotten; the dead ones go as they die)


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _overflowed(func, args: tuple, kwargs: dict, out: torch.Tensor) -> dict | None:
    """What a cast or a sum turned into -inf out of finite operands; None where it did not."""
    if func in CASTS:
        given = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if given is None or given.dtype == out.dtype or not given.is_floating_point() or \
                _largest(out.dtype) >= _largest(given.dtype):
            return None  # (a cast that cannot overflow costs nothing to look at: most casts are these)
        if not _has_neginf(out):
            return None
        inf = torch.isneginf(out)
        over = inf & torch.isfinite(given)
        if not bool(over.any()):
            return None
        value = float(given[over].min())
        return {"op": "cast", "value": value, "from": _dtype(given), "dtype": _dtype(out)}
    if not _has_neginf(out):
        return None
    inf = torch.isneginf(out)
    finite = torch.ones((), dtype=torch.bool, device=out.device)
    operands, numbers = [], []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            finite = finite & torch.isfinite(x)
            operands.append(x)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            if not math.isfinite(x):
                return None  # (-inf given: nothing overflowed)
            numbers.append(float(x))
    over = inf & finite
    if not bool(over.any()):
        return None
    low = [float(x.detach().broadcast_to(out.shape)[over].min()) for x in operands if x.dim() and x.is_floating_point()]
    name = "product" if func in PRODUCTS else "sum"
    found = {"op": name, "value": min(low) if low else None, "dtype": _dtype(out)}
    if numbers and name == "product":  # (`(1.0 - mask) * finfo.min`: the number it was scaled by, said beside the
        # tensor's value; a sum's number may be subtracted, so it stays "another mask")
        found["by"] = numbers[0]
    if func in ADDS and _kept(operands):
        found["kept"] = True
    return found


def _kept(operands: list) -> bool:
    """Whether a mask summed keeps a cell (0 or more) in every row: a causal plane's diagonal. Then no row of the sum
    is -inf only, whatever the other masks hold (a finite fill plus a kept cell stays finite): the overflow turned
    cells into -inf that the fill masked anyway, and no softmax over it gives NaN."""
    for x in operands:
        if x.dim() >= 2 and x.is_floating_point() and x.shape[-1] and bool((x.detach().amax(dim=-1) >= 0).all()):
            return True
    return False


def _bool_mask(args: tuple, filled: dict) -> torch.Tensor | None:
    """The first bool tensor of two or more dimensions among a sum's operands (a mask over keys, or over both), where
    it holds a False or was filled with a number (`filled`): one of only True made so (`torch.ones`) adds 1 to every
    score, which no softmax sees (ArcInstitute/state#227's fix, a 4-D mask of ones handed to Llama's eager path, where
    it is added); one a fill of -9e15 turned all True (mmdet#12351) lost the mask the fill meant."""
    return next((x for x in args if isinstance(x, torch.Tensor) and x.dtype == torch.bool and x.dim() >= 2
                 and (_filled(filled, x) or not bool(x.all()))), None)


def _filled(filled: dict, x: torch.Tensor) -> bool:
    ref = filled.get(id(x))
    return ref is not None and ref() is x


NARROW = (torch.float16, torch.bfloat16)
FILL = 1e4  # a number operand at least this large may be a fill (-1e4 already masks: inspect/polarity.py)


def may_overflow(args: tuple, kwargs: dict, out: torch.Tensor) -> bool:
    """Whether a sum or product, made while nothing is followed, may have turned a fill into -inf, by what is seen without
    reading a value (reading one is a reduction, and a device sync, on every sum a model runs): its result is float16 or
    bfloat16 (where fills overflow), square in its last two dimensions (a mask over (Lq, Lk) as a prefill builds it), a
    tensor operand of two or more dimensions is broadcast over the rows (a padding row (B, 1, 1, Lk) added to a causal
    plane), or a number operand is as large as a fill. What that leaves in float32 (residuals, norms, rotary products,
    a decode step's two (B, 1, 1, Lk) masks summed) is looked at only once something is followed (scores.py)."""
    shape = out.shape
    rows = shape[-2]
    if out.dtype in NARROW or rows == shape[-1] > 1:
        return True
    for x in (*args, *kwargs.values()) if kwargs else args:  # (every sum a model runs: each operand's shape read once)
        if isinstance(x, torch.Tensor):
            if rows > 1:
                own = x.shape
                if len(own) >= 2 and own[-2] == 1:
                    return True
        elif isinstance(x, (int, float)) and not -FILL < x < FILL:
            return True
    return False


@functools.lru_cache(maxsize=None)
def _largest(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def _has_neginf(out: torch.Tensor) -> bool:
    """Whether `out` holds -inf: its least value read back (one reduction: most sums and casts a model runs are
    looked at, so this is on trace's hot path); NaN anywhere makes that NaN, so then each cell is looked at."""
    if not out.numel():
        return False
    least = out.min().item()
    return least == -math.inf or (least != least and bool(torch.isneginf(out).any()))


class Overflows:
    """The tensors that hold a fill overflowed to -inf, or were computed from one, by identity (weak references)."""

    def __init__(self):
        self._found: dict[int, tuple[weakref.ref, dict]] = {}
        self._filled: dict[int, weakref.ref] = {}  # (bool tensors a number was filled into: _bool_mask)

    def wanted(self, func) -> bool:
        """Whether `func`'s result is looked at: a cast, a sum, or any call while a tensor is remembered."""
        return func in WATCHED or bool(self._found)

    def bool_filled(self, args: tuple, kwargs: dict, out) -> None:
        """Keep a bool tensor that a masked_fill filled with a number other than 0 or 1 (the number became True: the
        program meant a float mask). Whatever goes wrong here is the watch's: let go."""
        try:
            value = args[2] if len(args) > 2 else kwargs.get("value")
            if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool:
                value = value.item()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, 1):
                if len(self._filled) >= KEEP:
                    self._filled.clear()
                self._filled[id(out)] = weakref.ref(out)
        except Exception:  # noqa: BLE001 - the program's fill is made already
            pass

    def after(self, func, args: tuple, kwargs: dict, out, scores=None) -> None:
        """Note `out` where `func` overflowed a fill, added a bool mask to scores, or computed it from a noted tensor.
        Whatever goes wrong here is the watch's, never the program's: it is let go."""
        if not isinstance(out, torch.Tensor) or out.dim() < 2 or not out.is_floating_point():
            return
        if func in IN_PLACE:  # (a bool added to the scores in place is read here; otherwise an in-place add is looked
            added = _bool_mask(args, self._filled)  # at only as before: while a noted tensor may be added in)
            if added is not None and scores is not None and scores._found and scores.has(out):
                try:
                    self._note(out, {"op": "bool", "line": frames_outside(1)[0], "shape": list(added.shape)})
                except Exception:  # (the watch's, never the program's: let go)
                    pass
                return
            if not self._found:
                return
        if not self._found and (scores is None or not scores._found):  # the common case: only an overflow made here
            try:  # matters, and most sums and casts show at once that they made none (their result holds no -inf)
                if func in CASTS:
                    given = args[0] if args else None
                    if not isinstance(given, torch.Tensor) or given.dtype == out.dtype:
                        return
                elif not may_overflow(args, kwargs, out) or not _has_neginf(out.detach()):
                    return
            except Exception:  # (a tensor kind that cannot be read: the program runs on as it would)
                return
        grad = torch.is_grad_enabled()  # (most sums and casts a model runs pass here: no_grad as two C calls)
        try:
            torch._C._set_grad_enabled(False)
            self._after(func, args, kwargs, out, scores)
        except Exception:  # (a tensor kind the checks cannot read: sparse, nested; the program runs on as it would)
            pass
        finally:
            torch._C._set_grad_enabled(grad)

    def _after(self, func, args: tuple, kwargs: dict, out: torch.Tensor, scores) -> None:
        if func in ADDS and scores is not None:  # a bool mask added to scores: True adds 1, nothing is masked
            added = _bool_mask(args, self._filled)
            if added is not None and any(isinstance(x, torch.Tensor) and scores.has(x) for x in args):
                self._note(out, {"op": "bool", "line": frames_outside(1)[0], "shape": list(added.shape)})
                return
        if func in CASTS or func in SUMS:
            found = _overflowed(func, args, kwargs, out)
            if found is not None:
                found["line"] = frames_outside(1)[0]
                found["scores"] = scores is not None and any(isinstance(x, torch.Tensor) and scores.has(x) for x in args)
                self._note(out, found)
                return
        if not self._found:
            return
        for x in (*args, *kwargs.values()):
            found = self.get(x)
            if found is not None and tuple(x.shape[-2:]) == tuple(out.shape[-2:]):
                self._note(out, found)
                return

    def get(self, tensor) -> dict | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        found = self._found.get(id(tensor))
        return found[1] if found is not None and found[0]() is tensor else None

    def of(self, args: tuple, kwargs: dict, api: str) -> dict | None:
        """What overflowed in a tensor an attention call was given, if any did (or the bool mask added to it); for a
        softmax over it, the first batch row and head whose query rows are -inf everywhere (NaN), as "rows": [b, h,
        [q, ...]]. None where nothing did, or where the tensor cannot be read (the call is still recorded)."""
        try:
            return self._of(args, kwargs, api)
        except Exception:
            return None

    def _of(self, args: tuple, kwargs: dict, api: str) -> dict | None:
        if not self._found:
            return None
        for x in (*args, *kwargs.values()):
            found = self.get(x)
            if found is None or (found["op"] != "bool" and not _has_neginf(x.detach())):
                continue  # (-inf put back to a finite fill in place before the call, OLMo's ensure_finite_: none reached it)
            found = dict(found)
            if api == "softmax" and x.dim() in (3, 4) and found["op"] != "bool":
                empty = torch.isneginf(x.detach()).all(dim=-1).reshape(-1, x.shape[-2])  # (planes, Lq)
                planes = torch.nonzero(empty.any(dim=-1)).flatten()
                if len(planes):
                    plane, heads = int(planes[0]), (x.shape[1] if x.dim() == 4 else 1)
                    found["rows"] = [plane // heads, plane % heads, torch.nonzero(empty[plane]).flatten().tolist()[:64]]
            return found
        return None

    def _note(self, tensor: torch.Tensor, found: dict) -> None:
        kept = self._found  # (one dict for the trace's life: the mode reads it as "following")
        if len(kept) >= KEEP:
            kept.clear()
        key = id(tensor)

        def gone(ref) -> None:  # a tensor let go is forgotten at once, so the mode stops following when none is left
            entry = kept.get(key)
            if entry is not None and entry[0] is ref:  # (its id reused by a later tensor: that one keeps its own entry)
                del kept[key]

        try:
            kept[key] = (weakref.ref(tensor, gone), found)
        except TypeError:  # (a tensor subclass without weak references: not remembered)
            pass
