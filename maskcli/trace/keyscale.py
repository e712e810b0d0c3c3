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

_TABLES: tuple[dict, dict] = ({}, {})  # per pairing ("half", "interleaved"): direction bytes -> (norm, call serial)
_ADDED: deque = deque()  # (serial, the direction bytes it added to each table)
_SERIAL = [0]


def keys_rescaled(k: torch.Tensor, k_shape: tuple) -> dict:
    """{"keys_rescaled": {...}} where keys of earlier calls come back scaled by one factor, else {}; this call's key
    rows are kept to be found again."""
    if len(k_shape) != 4 or k_shape[-1] % 2 or k_shape[-1] < 8 or k_shape[0] * k_shape[1] * k_shape[2] > ROWS:
        return {}
    try:
        if not k.is_cpu or type(k) is not torch.Tensor or k.dtype not in (torch.float32, torch.float64):
            return {}
        squares = np.square(k.detach().reshape(-1, k_shape[-1]).numpy())
    except Exception:  # noqa: BLE001 - a tensor not read here (fake, meta, a subclass's) states no key
        return {}
    _SERIAL[0] += 1
    serial, half = _SERIAL[0], k_shape[-1] // 2
    total = np.sqrt(squares.sum(axis=1, dtype=np.float64))
    usable = total > 1e-6
    added, found = [], None
    for table, pairs in zip(_TABLES, ((squares[:, :half], squares[:, half:]), (squares[:, 0::2], squares[:, 1::2]))):
        norms = np.sqrt(pairs[0] + pairs[1])
        directions = np.round(norms[usable] / total[usable, None], DIGITS) + 0.0  # (+ 0.0: no -0.0 of its own bytes)
        varied = np.ptp(directions, axis=1) > 10 ** -DIGITS  # (pairs all alike, `ones`: any such row is any other)
        directions, totals = directions[varied], total[usable][varied]
        keys = [row.tobytes() for row in directions]
        back = [(key, total_now / held[0]) for key, total_now in zip(keys, totals)
                if (held := table.get(key)) is not None and held[1] != serial]
        found = found or _scaled(back, int(squares.shape[0]))
        for key, norm in zip(keys, totals):
            table[key] = (norm, serial)
        added.append(keys)
    _forget(serial, added)
    return {"keys_rescaled": found} if found else {}


def forget() -> None:
    """A trace ended: its keys let go (another trace's keys, the same program --fixed, must find none of them)."""
    for table in _TABLES:
        table.clear()
    _ADDED.clear()


def _scaled(back: list, rows: int) -> dict | None:
    """The factor the rows that came back scaled (direction, ratio) share, where two or more of other directions did
    and it is one; else None."""
    ratios = np.asarray([ratio for _, ratio in back], dtype=np.float64)
    scaled = np.abs(ratios - 1) > SCALED
    off = ratios[scaled]
    if len({key for (key, _), out in zip(back, scaled) if out}) < 2 or np.abs(off - off[0]).max() > TOLERANCE * off[0]:
        return None
    return {"factor": round(float(off.mean()), 4), "keys": int(off.size), "found": int(ratios.size), "of": rows}


def _forget(serial: int, added: list) -> None:
    """This call's rows kept; those of the call KEPT calls back dropped (where no later call wrote them again)."""
    _ADDED.append((serial, added))
    while len(_ADDED) > KEPT:
        old, keys = _ADDED.popleft()
        for table, rows in zip(_TABLES, keys):
            for key in rows:
                held = table.get(key)
                if held is not None and held[1] == old:
                    del table[key]
