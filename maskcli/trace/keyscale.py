"""Keys an earlier call read, read again scaled: moved in the cache by something that is not a rotation.

A rotary embedding turns each pair of a key's dimensions (d, d + D/2 as `rotate_half` pairs them, or 2d, 2d + 1
interleaved) by an angle; moving a cached key to another position (a press that prunes the cache and re-rotates the
kept keys to slots 0..n-1: kvpress' KeyRerotationPress, StreamingLLM's sink cache) turns each pair again, which
keeps every pair's norm. So a key an earlier call read comes back, wherever it sits now, with the same norm in every
pair. One that comes back with every pair's norm times one factor c was scaled on its way (the un-rotation and
re-rotation made with a rotary's cos/sin that carry YaRN's `attention_scaling`: NVIDIA/kvpress#85, c =
attention_scaling²): its logits are c times what the kernel gave the same key before, against the fresh keys of the
same call that are not.

Recorded per SDPA call: each key row's pair norms divided by its norm (rounded: the key's direction within its pairs,
which no rotation and no scaling changes) looked up among those of the last KEPT calls' keys; a row found there gives
the ratio of its norm to the earlier one's. Where two rows or more come back scaled, all by one factor c (not 1),
details `keys_rescaled` says c, how many, how many came back at all, and of how many keys. Read only on the CPU, for
float32/float64 keys (bfloat16's rounding is larger than any tolerance here) of at most ROWS rows (batch x heads x
keys): a cheap look for small runs, none for large caches.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

ROWS = 1024  # key rows (B x H x L) read at most per call
KEPT = 16  # calls whose key rows are kept to be found again
DIGITS = 3  # decimals of a row's direction within its pairs (its lookup key)
TOLERANCE = 1e-4  # relative spread of one factor (float32 rotations keep norms to ~1e-6)
SCALED = 1e-3  # a factor this far from 1 or further is a scaling

_HELD: tuple[deque, deque] = (deque(), deque())  # per pairing ("half", "interleaved"), the last KEPT calls' rows:
# (their directions' hashes sorted, each one's norm), newest last
_MULTIPLIERS: dict[int, np.ndarray] = {}  # a direction's length -> the odd int64 weights that hash it


def keys_rescaled(k: torch.Tensor, k_shape: tuple) -> dict:
    """{"keys_rescaled": {...}} where keys of earlier calls come back scaled by one factor, else {}; this call's key
    rows are kept to be found again. (Each row's direction is hashed to one int64 and looked up with numpy: a Python
    lookup a row cost milliseconds a call at ROWS rows.)"""
    if len(k_shape) != 4 or k_shape[-1] % 2 or k_shape[-1] < 8 or k_shape[0] * k_shape[1] * k_shape[2] > ROWS:
        return {}
    try:
        if not k.is_cpu or type(k) is not torch.Tensor or k.dtype not in (torch.float32, torch.float64):
            return {}
        squares = np.square(k.detach().reshape(-1, k_shape[-1]).numpy())
    except Exception:  # noqa: BLE001 - a tensor not read here (fake, meta, a subclass's) states no key
        return {}
    half = k_shape[-1] // 2
    total = np.sqrt(squares.sum(axis=1, dtype=np.float64))
    usable = total > 1e-6
    found = None
    for held, pairs in zip(_HELD, ((squares[:, :half], squares[:, half:]), (squares[:, 0::2], squares[:, 1::2]))):
        norms = np.sqrt(pairs[0] + pairs[1])
        directions = np.rint(norms[usable] / total[usable, None] * 10 ** DIGITS).astype(np.int64)  # (DIGITS decimals)
        varied = np.ptp(directions, axis=1) > 1  # (pairs all alike, `ones`: any such row is any other)
        hashes = (directions[varied] * _weights(half)).sum(axis=1)  # (int64 wraps: a hash, not a sum)
        totals = total[usable][varied]
        ratios, keys = _back(held, hashes, totals)
        found = found or _scaled(keys, ratios, int(squares.shape[0]))
        order = np.argsort(hashes, kind="stable")
        held.append((hashes[order], totals[order]))
        if len(held) > KEPT:
            held.popleft()
    return {"keys_rescaled": found} if found else {}


def _weights(length: int) -> np.ndarray:
    weights = _MULTIPLIERS.get(length)
    if weights is None:
        weights = _MULTIPLIERS[length] = np.random.default_rng(length).integers(1, 1 << 62, size=length, dtype=np.int64) | 1
    return weights


def _back(held: deque, hashes: np.ndarray, totals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ratio of each row found to its norm when last read, its hash) for this call's rows an earlier kept call read
    (the newest that did)."""
    ratio = np.full(hashes.shape, np.nan)
    todo = np.ones(hashes.shape, bool)
    for before, norms in reversed(held):
        if not before.size or not todo.any():
            continue
        at = np.minimum(np.searchsorted(before, hashes), before.size - 1)
        hit = todo & (before[at] == hashes)
        ratio[hit] = totals[hit] / norms[at[hit]]
        todo &= ~hit
    return ratio[~todo], hashes[~todo]


def forget() -> None:
    """A trace ended: its keys let go (another trace's keys, the same program --fixed, must find none of them)."""
    for held in _HELD:
        held.clear()


def _scaled(keys: np.ndarray, ratios: np.ndarray, rows: int) -> dict | None:
    """The factor the rows that came back scaled (their hashes, ratios) share, where two or more of other directions
    did and it is one; else None."""
    scaled = np.abs(ratios - 1) > SCALED
    off, directions = ratios[scaled], keys[scaled]
    if not (directions != directions[:1]).any() or np.abs(off - off[0]).max() > TOLERANCE * off[0]:
        return None
    return {"factor": round(float(off.mean()), 4), "keys": int(off.size), "found": int(ratios.size), "of": rows}
