"""A masked_fill of scores whose result the program threw away: the softmax then runs over the scores unfilled.

`scores.masked_fill(mask, -1e9)` is out of place: where its result is never bound (`a.masked_fill(...)` as a statement,
mead-baseline#223; ParlAI#3068's `l1.masked_fill(attn_mask, neginf)`), the scores the softmax reads are the ones
before it, and the keys the fill was to hide take weight. The fill is still the program's own statement of what it
hides. So each out-of-place masked_fill with a masking value (-inf, the dtype's lowest, or at most -1e4: a fill as
trace/masks.py reads one) is remembered by the identity of the tensor it filled (weak references: nothing is kept
alive), and a softmax over that very tensor, unchanged since (its version) while the fill's result is already gone
(never used: freed before the softmax ran), is attention whatever its shape (the fill says what it masks: additive
Bahdanau scores made by a Linear, no q @ kᵀ), and its call records the cells the fill would hide (details
`fill_discarded`: checks/discarded.py).

A fill bound to a name and never read is thrown away as much (arghosh/AKT 01b7e8d: `scores_ = scores.masked_fill(mask
== 0, -1e32)`, then `scores_ = F.softmax(scores, dim=-1)`, the name rebound to a softmax over the scores unfilled). So
the fills of scores are followed until read: a softmax over the scores they filled, while their result is alive and no
call has read it yet, records the cells too, with `bound`; a call that reads the result later takes that back.
"""

from __future__ import annotations

import functools
import numbers
import weakref

import torch

FILLS = frozenset({torch.masked_fill, torch.Tensor.masked_fill})  # (out of place: the in-place masked_fill_ fills
# the scores themselves)
FILL_AT_MOST = -1e4  # (a fill: as trace/masks.py reads one in scores)
KEEP = 64  # fills remembered at most (more: all forgotten)
MOST = 1 << 20  # cells of a fill's mask read at most


def wanted(args: tuple, kwargs: dict, out) -> bool:
    """An out-of-place masked_fill of floating scores of 2 dimensions or more with a masking value (entry.py)."""
    try:
        found = _wanted(args, kwargs, out)
    except Exception:  # noqa: BLE001 - nothing of the trace may reach the program: a call not read is no fill
        return False
    _LAST[0] = out if found else None  # (Discarded.after, next, need not ask again)
    return found


_LAST = [None]  # the result of the fill `wanted` last let through (alive while its call returns: no other has its id)


def _wanted(args: tuple, kwargs: dict, out) -> bool:
    value = _value(args, kwargs)  # (first: most fills of a program are no masking fill, and a float is read fastest)
    if value is None or not value <= FILL_AT_MOST and (not value < 0 or not isinstance(out, torch.Tensor)
                                                       or not out.is_floating_point() or value != _lowest(out.dtype)):
        return False
    given = args[0] if args else kwargs.get("input", kwargs.get("self"))
    return isinstance(out, torch.Tensor) and isinstance(given, torch.Tensor) and given.dim() >= 2 \
        and out.is_floating_point() and out.numel() <= MOST


@functools.lru_cache(maxsize=None)
def _lowest(dtype) -> float:
    return torch.finfo(dtype).min


def _value(args: tuple, kwargs: dict) -> float | None:
    value = args[2] if len(args) > 2 else kwargs.get("value")
    if type(value) is float:
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.device.type != "cpu":  # (reading a device's scalar would wait on the device)
            return None
        try:
            value = value.item()
        except Exception:  # noqa: BLE001 - a fake or wrapped scalar (meta, vmap): no value to read here
            return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return float(value) if isinstance(value, numbers.Real) and type(value).__name__ != "bool_" else None  # (numpy's
    # int64 and float32 scalars, which torch takes as fill values; numpy's bool_ is no number here)


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter; None for one made under torch.inference_mode, which keeps none (its cells, read at
    the softmax, still show a fill written since: checks/discarded.py judges only cells the kernel sees)."""
    return None if tensor.is_inference() else tensor._version


class Discarded:
    """The out-of-place fills of the run, by the identity of the scores they filled (module docstring)."""

    def __init__(self):
        self._found: dict[int, tuple] = {}  # id(scores) -> (ref to scores, their version, ref to the fill's result,
        # the mask, the value)
        self.results: dict[int, list] = {}  # id(a fill's result) -> [ref to it, read since, the details that say it unread]

    def after(self, func, args: tuple, kwargs: dict, out) -> None:
        """Remember an out-of-place fill of a masking value (what `wanted` lets through)."""
        try:
            self._after(func, args, kwargs, out)
        except Exception:  # noqa: BLE001 - nothing of the trace may reach the program: a fill not read is forgotten
            pass

    def _after(self, func, args: tuple, kwargs: dict, out) -> None:
        if func not in FILLS or (_LAST[0] is not out and not wanted(args, kwargs, out)):
            return
        _LAST[0] = None
        given = args[0] if args else kwargs.get("input", kwargs.get("self"))
        mask = args[1] if len(args) > 1 else kwargs.get("mask")
        if not isinstance(mask, torch.Tensor) or mask.numel() > MOST:
            return
        found, results = self._found, self.results
        if len(found) >= KEEP:  # (an entry whose scores are gone stays until then: dropped() compares the reference, and
            found.clear()  # a callback made per fill cost more than the fill, in a loop of fills of no attention)
            results.clear()
        try:
            found[id(given)] = (weakref.ref(given), _version(given), weakref.ref(out),
                                mask.detach() if mask.requires_grad else mask, _value(args, kwargs))
            results[id(out)] = [found[id(given)][2], False, []]
        except TypeError:
            pass

    def reads(self, args: tuple, kwargs: dict) -> None:
        """A call that reads a fill's result (any tensor argument, or one in a list): the fill was not thrown away."""
        results = self.results
        for x in (*args, *kwargs.values()):
            for one in (x if isinstance(x, (list, tuple)) else (x,)):
                entry = results.get(id(one)) if isinstance(one, torch.Tensor) else None
                if entry is not None and entry[0]() is one and not entry[1]:
                    entry[1] = True
                    for details in entry[2]:
                        details.pop("fill_discarded", None)

    def dropped(self, x, bound: bool = False) -> tuple | None:
        """(mask, value, the result's entry or None) of a fill of `x` whose result is gone (`bound`: or alive and read by
        no call yet) while `x` is unchanged since; None where there is none."""
        if not self._found or not isinstance(x, torch.Tensor):
            return None
        entry = self._found.get(id(x))
        try:
            if entry is None or entry[0]() is not x or entry[1] != _version(x):
                return None
            result = entry[2]()
            held = self.results.get(id(result)) if result is not None else None
            if result is not None and (not bound or held is None or held[0]() is not result or held[1]):
                return None
        except Exception:  # noqa: BLE001 - a tensor whose version cannot be read (a wrapped one): no statement here
            return None
        return entry[3], entry[4], held

    def note(self, x, call, seen, bound: bool = False) -> None:
        """At softmax `call` (read as `seen`) over `x`: details `fill_discarded` (the cells the dropped fill would hide,
        as the call's (b, h, Lq, Lk), and its value) where such a fill was made of `x` (`bound`: or its result is alive
        and unread, then taken back where a later call reads it)."""
        found = self.dropped(x, bound)
        if found is None or "axes" in seen.details or seen.keep is None:
            return
        mask, value, held = found
        with torch.no_grad():
            try:
                hidden = mask.to(torch.bool).broadcast_to(x.shape).reshape(seen.keep.shape)
            except RuntimeError:
                return
        said = {"hidden": hidden.cpu().numpy(), "value": value}
        if held is not None:
            said["bound"] = True
            held[2].extend((call.details, seen.details))
        call.details["fill_discarded"] = seen.details["fill_discarded"] = said

    def kernel(self, call, args: tuple, kwargs: dict) -> None:
        """At an SDPA `call`: details `fill_discarded` where its attn_mask is a tensor the program filled out of place
        and threw the fill away (Qwen#933: `attention_mask.masked_fill(~causal_mask, min)` as a statement, the
        additive padding mask handed on unfilled), the cells that fill would hide broadcast to the call's shape."""
        if call.api != "sdpa" or not self._found:
            return
        try:
            given = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            found = self.dropped(given)
            if found is None or not given.is_floating_point():  # (a mask handed to SDPA: only a fill gone is read)
                return
            with torch.no_grad():
                hidden = found[0].to(torch.bool).broadcast_to(given.shape).broadcast_to(call.shape)
            call.details["fill_discarded"] = {"hidden": hidden.cpu().numpy(), "value": found[1]}
        except Exception:  # noqa: BLE001 - nothing of the trace may reach the program: a mask not read says nothing
            return
