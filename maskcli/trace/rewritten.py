"""A batch's token mask that a model call's own forward rewrote in the batch it was handed, then ran again with.

A program hands its model a batch that holds its token ids and their mask (sentence-transformers' `features` dict, a
BatchEncoding, a dataclass): the mask the tokenizer made states which positions are tokens. Where the model's forward
writes another mask back into that batch (sentence-transformers#3944: Pooling replaced `features["attention_mask"]`
with the prompt-excluded pooling mask), the next call on the same batch, the same ids, runs its encoder with the
rewritten mask: the prompt's tokens hidden as keys. So each outermost call is looked at as it begins (its first
attention call) and as it ends: every batch among its arguments (one level into a list or tuple) holding a small 2-D
integer or bool `*mask` field beside an ids field (`input_ids`, `*_ids`, `tokens`) of the same shape has its mask
copied (a few hundred elements at most), and at the end a mask field that is another tensor, or the same edited in
place, with some position a token before and not after, the ids unchanged (the same tensor, not edited), is kept as a
rewrite. A later call that begins with that very tensor still in the same batch, beside the same ids, has the rewrite
kept on its Top (`rewritten`: checks/rewritten.py holds its attention calls against it). Nothing of the program's is
held past a call but weak references to the two tensors.
"""

from __future__ import annotations

import weakref
from collections import UserDict

import torch

from maskcli.trace.unseen import unseen

MOST = 1 << 14  # elements of a mask copied at most
IDS_SKIPPED = ("token_type_ids", "position_ids")


def _fields(value):
    """The dict of a batch's fields: a dict's own, a UserDict's (BatchEncoding) `data`, a plain object's `__dict__`;
    else None. No program method is called."""
    if type(value) is dict:
        return value
    if isinstance(value, UserDict):
        data = value.__dict__.get("data")
        return data if type(data) is dict else None
    if isinstance(value, (torch.Tensor, torch.nn.Module, type)) or not hasattr(type(value), "__dataclass_fields__"):
        return None
    fields = getattr(value, "__dict__", None)
    return fields if type(fields) is dict else None


def _small(value) -> bool:
    return type(value) is torch.Tensor and value.dim() == 2 and 0 < value.numel() <= MOST and value.device.type != "meta" \
        and (value.dtype == torch.bool or not value.is_floating_point())


def _batches(module, args: tuple, kwargs: dict) -> list:
    """(name, fields, the field as written, mask name, mask, its version, its values, ids name, ids, their version) of
    each batch handed
    (positional arguments named by the forward's signature)."""
    from maskcli.trace.tops import _given

    found, seen = [], set()
    for name, value in _given(module, args, kwargs)[1].items():
        inner = [(name, value)]
        if isinstance(value, (list, tuple)) and len(value) <= 16:
            inner += [(f"{name}[{i}]", v) for i, v in enumerate(value)]
        for where, held in inner:
            fields = _fields(held)
            shown = (lambda n, where=where: f"{where}.{n}") if fields is not None and fields is getattr(held, "__dict__", None) \
                else (lambda n, where=where: f"{where}['{n}']")
            if fields is None or id(fields) in seen:
                continue
            seen.add(id(fields))
            ids = next(((n, v) for n, v in fields.items() if isinstance(n, str) and n not in IDS_SKIPPED
                        and (n.endswith("ids") or n == "tokens") and _small(v) and v.dtype != torch.bool), None)
            if ids is None:
                continue
            for n, v in fields.items():
                if isinstance(n, str) and n.endswith("mask") and _small(v) and v.shape == ids[1].shape:
                    with unseen():  # (maskcli's own reads: no mode sees them)
                        values_now = v.detach().cpu().numpy() != 0
                    found.append((where, fields, shown(n), n, v, v._version, values_now, ids[0], ids[1], ids[1]._version))
    return found


class Rewrites:
    """The batches of each running outermost call, their masks rewritten by a call, and the calls that ran with them."""

    def __init__(self) -> None:
        self._begun: dict = {}  # id(held) -> the batches it was handed, as it began
        self._done: dict = {}  # id(fields) -> (mask ref, its version, ids ref, their version, before, after, by, first)
        self.kept: dict = {}  # first call index of an outermost call -> the rewrites it began with

    def begin(self, key: int, first: int, module, args: tuple, kwargs: dict) -> None:
        """An outermost call of `module` begins (`key`: its held list's id; `first`: its first attention call)."""
        try:
            batches = _batches(module, args, kwargs)
        except (Exception, SystemExit):  # noqa: BLE001 - the program's objects stay its own
            return
        if not batches:
            return
        self._begun[key] = batches
        for where, fields, shown, name, mask, version, values, _, ids, ids_version in batches:
            done = self._done.get(id(fields))
            if done is None or done[0]() is not mask or done[1] != version or done[2]() is not ids \
                    or done[3] != ids_version or done[8] != name:
                continue
            self.kept.setdefault(first, []).append({"batch": where, "field": name, "held": shown, "before": done[4],
                                                    "after": done[5], "by": done[6], "call": done[7]})

    def begun(self, key: int) -> bool:
        """Whether the call held as `key` was handed a batch."""
        return key in self._begun

    def drop(self, key: int) -> None:
        """The call held as `key` finished where its end was not seen (a first call whose return was not watched): what
        it was handed, let go unread (the program may have changed it since)."""
        self._begun.pop(key, None)

    def end(self, key: int, first: int, where: str) -> None:
        """An outermost call (`where`) ends, now (its post hook, or its frame's return for a module's first call): each
        mask it rewrote in a batch it was handed, kept for a later call."""
        for _, fields, _, name, mask, version, values, ids_name, ids, ids_version in self._begun.pop(key, ()):
            try:
                now = fields.get(name)
                if now is mask and now._version == version or not _small(now) or now.shape != mask.shape \
                        or fields.get(ids_name) is not ids or ids._version != ids_version:
                    continue
                with unseen():  # (maskcli's own reads: no mode sees them)
                    after = now.detach().cpu().numpy() != 0
                if not (values & ~after).any():
                    continue
                self._done[id(fields)] = (weakref.ref(now), now._version, weakref.ref(ids), ids_version, values, after,
                                          where, first, name)
            except (Exception, SystemExit):  # noqa: BLE001 - the program's objects stay its own
                continue

    def attach(self, tops: list) -> None:
        """Each kept rewrite onto the Top of the call that began with it (`rewritten`)."""
        if not self.kept:
            return
        for top in tops:
            found = self.kept.get(getattr(top, "first", None))
            if found and hasattr(top, "rewritten"):
                top.rewritten = tuple(found)


def rewrites(trace) -> Rewrites:
    """The trace's Rewrites, made at its first outermost call."""
    found = trace.__dict__.get("_rewrites")
    if found is None:
        found = trace.__dict__["_rewrites"] = Rewrites()
    return found
