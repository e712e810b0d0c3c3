"""What each layer's KV cache handed to attention at each step, read off the cache object while generate runs.

transformers' `Cache.update` returns the keys a layer attends over, and `Cache.get_mask_sizes` tells
masking_utils how wide the mask is and where its keys start (kv_length, kv_offset): the mask's key
column j stands for position kv_offset + j. Both are wrapped while maskcli watches (the arguments and
results pass through untouched). Which position each returned key slot holds is found from the keys
themselves: every key fed to the cache is kept by its position (the cache's cumulative length before
the call, plus its index), and each returned slot is the fed key it equals. So a dynamic cache, a
static one (slots from 0, the ones not yet written hold no key), a sliding layer that shifts its keys
(transformers 5: DynamicSlidingWindowLayer, StaticSlidingWindowLayer's roll) and a ring buffer are all
read the same way, without trusting any of their bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SLOTS_AT_ONCE = 64  # slots compared with every kept key at once, where the keys are not in order


@dataclass
class Update:
    """One layer's cache call at one step: where its returned keys sit, and what its mask was told."""

    layer: int
    step: int
    seen: int  # the cache's tokens before this call (its cumulative length: absolute positions, padding included)
    new: int  # keys added by this call
    slots: np.ndarray  # int64 (n,): the absolute position each returned key holds; -1: the slot holds no key yet
    sizes: tuple[int, int] | None  # (kv_length, kv_offset) the cache gave masking_utils for this layer's kind of mask
    sliding: bool  # the cache layer says it is a sliding one

    def in_order(self) -> bool:
        """Slots hold consecutive positions, the ones not yet written (if any) after them."""
        filled = self.slots[self.slots >= 0]
        count = len(filled)
        return bool((self.slots[count:] < 0).all() and (count == 0 or (np.diff(filled) == 1).all()))

    def first(self) -> int:
        """The position of slot 0 where the slots are in order; a static cache's empty slots count on from the last."""
        filled = self.slots[self.slots >= 0]
        return int(filled[0]) if len(filled) else (self.sizes[1] if self.sizes else 0)


class Watch:
    """`with Watch(): generate(...)`: every Cache.update and Cache.get_mask_sizes recorded as Updates (.updates)."""

    def __init__(self, pause=None):
        self.updates: list[Update] = []
        self._pause = pause  # a context manager factory: the trace's mode off the stack while our own torch ops run
        self._kept: dict = {}  # (id(cache), layer) -> (room for the keys fed so far, (B, H, >=T, D); T)
        self._sizes: dict = {}  # (id(cache), sliding or None) -> the latest (kv_length, kv_offset)
        self._steps: dict = {}
        self._held: list = []  # the caches, so that their ids stay theirs while watched

    def __enter__(self) -> Watch:
        from transformers.cache_utils import Cache

        self._cls = Cache
        self._update, self._mask_sizes = Cache.update, Cache.get_mask_sizes
        watch = self

        def update(cache, key_states, value_states, layer_idx, *args, **kwargs):
            layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
            seen = _length(layer) if layer is not None and getattr(layer, "is_initialized", False) else 0
            keys, values = watch._update(cache, key_states, value_states, layer_idx, *args, **kwargs)
            watch._record(cache, int(layer_idx), seen, key_states, keys)
            return keys, values

        def get_mask_sizes(cache, query_length, layer_idx, *args, **kwargs):
            found = watch._mask_sizes(cache, query_length, layer_idx, *args, **kwargs)
            layer = cache.layers[layer_idx] if layer_idx < len(cache.layers) else None
            kinds = (None,) if layer is None else (bool(getattr(layer, "is_sliding", False)),)
            for kind in kinds:
                watch._sizes[(id(cache), kind)] = (int(found[0]), int(found[1]))
            if layer is None:  # no layer yet (a dynamic cache before its first update): every kind of mask is this wide
                watch._sizes[(id(cache), True)] = watch._sizes[(id(cache), False)] = (int(found[0]), int(found[1]))
            return found

        Cache.update, Cache.get_mask_sizes = update, get_mask_sizes
        return self

    def __exit__(self, *exc) -> None:
        self._cls.update, self._cls.get_mask_sizes = self._update, self._mask_sizes
        self._kept.clear()
        self._held.clear()

    def _record(self, cache, layer_idx: int, seen: int, new_keys: torch.Tensor, keys: torch.Tensor) -> None:
        import contextlib

        with (self._pause() if self._pause else contextlib.nullcontext()), torch.no_grad():
            if not any(c is cache for c in self._held):
                self._held.append(cache)
            where = (id(cache), layer_idx)
            buffer, length = self._kept.get(where, (None, 0))
            new = new_keys.shape[2]
            if buffer is None or length != seen or buffer.shape[:2] != new_keys.shape[:2] or buffer.shape[3] != new_keys.shape[3]:
                buffer, length = None, seen  # keys fed before we watched (or another cache's): unknown, zeros
            if buffer is None or buffer.shape[2] < seen + new:  # room doubles: copying every kept key at each step is O(L^2)
                grown = new_keys.new_zeros(new_keys.shape[:2] + (max(2 * (seen + new), 16), new_keys.shape[3]))
                if buffer is not None:
                    grown[:, :, :length] = buffer[:, :, :length]
                buffer = grown
            buffer[:, :, seen:seen + new] = new_keys.detach()
            self._kept[where] = (buffer, seen + new)
            kept = buffer[:, :, :seen + new]
            step = self._steps.get(where, 0)
            self._steps[where] = step + 1
            layer = cache.layers[layer_idx]
            sliding = bool(getattr(layer, "is_sliding", False))
            self.updates.append(Update(layer_idx, step, seen, int(new_keys.shape[2]), slot_positions(keys.detach(), kept),
                                       self._sizes.get((id(cache), sliding)), sliding))


def _length(layer) -> int:
    """The cache layer's tokens so far: its cumulative length where it keeps one, else its keys' length."""
    for name in ("cumulative_length_int", "cumulative_length"):
        value = getattr(layer, name, None)
        if value is not None:
            return int(value)
    return int(layer.get_seq_length())


def slot_positions(keys: torch.Tensor, kept: torch.Tensor) -> np.ndarray:
    """The position (index into `kept`'s keys) each slot of `keys` holds, -1 where it holds none of them.

    Tried first in order: the last n positions (a dynamic or shifting cache), then from position 0 with the
    slots past the last one empty (a static cache); else each slot against every kept key. Two positions with
    the same key (padding tokens at the same position id) are told apart by the order the other slots keep.
    """
    n, total = keys.shape[2], kept.shape[2]
    for start in (total - n, 0):
        if start < 0:
            continue
        filled = min(n, total - start)
        if torch.equal(keys[:, :, :filled], kept[:, :, start:start + filled]):
            return np.concatenate([np.arange(start, start + filled), np.full(n - filled, -1)]).astype(np.int64)
    out = np.full(n, -1, dtype=np.int64)
    previous = -2
    for lo in range(0, n, SLOTS_AT_ONCE):
        block = keys[:, :, lo:lo + SLOTS_AT_ONCE]
        equal = (block[:, :, :, None, :] == kept[:, :, None, :, :]).all(dim=4).all(dim=1).all(dim=0)  # (slots, T)
        for j in range(equal.shape[0]):
            found = equal[j].nonzero().flatten().tolist()
            if found:
                out[lo + j] = previous + 1 if previous + 1 in found else found[0]
            previous = out[lo + j]
    return out
