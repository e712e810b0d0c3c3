"""Keys an earlier call read, read again scaled: moved in the cache by something that is not a rotation.

A rotary embedding turns each pair of a key's dimensions (d, d + D/2 as `rotate_half` pairs them, or 2d, 2d + 1
interleaved) by an angle; moving a cached key to another position (a press that prunes the cache and re-rotates the
kept keys to slots 0..n-1: kvpress' KeyRerotationPress, StreamingLLM's sink cache) turns each pair again, which
keeps every pair's norm. So a key an earlier call read comes back, wherever it sits now, with the same norm in every
pair. One that comes back with every pair's norm times one factor c was scaled on its way (the un-rotation and
re-rotation made with a rotary's cos/sin that carry YaRN's `attention_scaling`: NVIDIA/kvpress#85, c =
attention_scaling²): its logits are c times what the kernel gave the same key before, against the fresh keys of the
same call that are not.

Read at an SDPA call with no more keys than its site's last call (a cache pruned, shifted or rebuilt between two calls
of one layer, not one that grew; capture.py names the site through `at`): each key row's pair
norms divided by its norm (rounded: the key's direction within its pairs, which no rotation and no scaling changes)
looked up among those of the site's last call's keys; a row found there gives the ratio of its norm to the earlier
one's. Where two rows or more come back scaled, all by one factor c (not 1), details `keys_rescaled` says c, how
many, how many came back at all, and of how many keys. A call whose keys grew (a decode step) costs a lookup and
nothing more. Read only on the CPU, for float32/float64 keys (bfloat16's rounding is larger than any
tolerance here), and only batch row 0's first head, of at most ROWS keys: a press moves every head's keys alike.
"""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.embedids import hash_weights
from maskcli.trace.hostview import host

ROWS = 1024  # keys of batch row 0's first head read at most per call
DIGITS = 3  # decimals of a row's direction within its pairs (its lookup key)
TOLERANCE = 1e-4  # relative spread of one factor (float32 rotations keep norms to ~1e-6)
EXACT = 1e-5  # largest change of a row's unrounded direction within its pairs that is still no change
SCALED = 1e-3  # a factor this far from 1 or further is a scaling

_SITE: list = [None]  # the site of the call being read (set by `at`, from capture.py)
_LAST: dict = {}  # site -> (its last call's keys, their count)


def at(site: tuple, where: str) -> tuple:
    """(site, where) of the call about to be read, kept as the site keys_rescaled compares within."""
    _SITE[0] = site
    return site, where


def last_keys(k_shape: tuple) -> torch.Tensor | None:
    """The keys of the site's last call where this call reads no more of them (sinkblend.py compares them), else None."""
    last = _LAST.get(_SITE[0])
    return None if last is None or len(k_shape) != 4 or k_shape[2] > last[1] else last[0]


def keys_rescaled(k: torch.Tensor, k_shape: tuple) -> dict:
    """{"keys_rescaled": {...}} where keys of the site's last call come back scaled by one factor, else {}."""
    if len(k_shape) != 4 or k_shape[-1] % 2 or k_shape[-1] < 8 or k_shape[2] > ROWS or not k_shape[0] * k_shape[1]:
        return {}
    try:
        if not k.is_cpu or type(k) is not torch.Tensor or k.dtype not in (torch.float32, torch.float64):
            return {}
        site = _SITE[0]
        last = _LAST.get(site)
        _LAST[site] = (k, k_shape[2])  # (the tensor itself: its plane is made only where it is compared)
        if last is None or k_shape[2] > last[1] or k.data_ptr() == last[0].data_ptr():
            return {}  # (the site's first call, a cache that grew: a step that appends its own keys, one buffer written in
            # place; not the query count: Hugging Face packs a GQA decode's heads into the query axis)
        with np.errstate(all="ignore"):  # (a cache's unwritten slots, torch.empty's: whatever they hold squares to inf
            # or NaN, which numpy would warn of under the program's line; its own numpy is left as it was)
            before, now = np.square(host(last[0])[0, 0]), np.square(host(k)[0, 0])
    except Exception:  # noqa: BLE001 - a tensor not read here (fake, meta, a subclass's) states no key
        return {}
    if before.shape[1] != now.shape[1]:
        return {}
    with np.errstate(all="ignore"):
        return _rescaled(before, now)


def _rescaled(before: np.ndarray, now: np.ndarray) -> dict:
    """keys_rescaled's reading of two calls' squared keys (batch row 0's first head)."""
    found = None
    for pairing in (0, 1):
        held = {key: (norm, exact) for key, norm, exact in zip(*_directions(before, pairing))}
        # (the rounded direction finds a row; the same direction unrounded says it came back whole: a key blended
        # with another one on the way, an EMA sink's alpha * sink + (1 - alpha) * new, turns its pairs a little)
        back = [(key, norm / held[key][0]) for key, norm, exact in zip(*_directions(now, pairing))
                if key in held and np.abs(exact - held[key][1]).max() <= EXACT]
        found = found or (_scaled(back, int(now.shape[0])) if len(back) > 1 else None)
    return {"keys_rescaled": found} if found else {}


def _directions(squares: np.ndarray, pairing: int) -> tuple[list, list, np.ndarray]:
    """(hash of each row's direction within its pairs, its norm, that direction unrounded) for rows not all alike,
    pairing 0 as rotate_half pairs (d, d + D/2), 1 interleaved (2d, 2d + 1)."""
    half = squares.shape[1] // 2
    pairs = (squares[:, :half], squares[:, half:]) if pairing == 0 else (squares[:, 0::2], squares[:, 1::2])
    total = np.sqrt(squares.sum(axis=1, dtype=np.float64))
    usable = total > 1e-6
    norms = np.sqrt(pairs[0] + pairs[1])
    exact = norms[usable] / total[usable, None]
    directions = np.rint(exact * 10 ** DIGITS).astype(np.int64)  # (DIGITS decimals)
    varied = np.ptp(directions, axis=1) > 1  # (pairs all alike, `ones`: any such row is any other)
    return ((directions[varied] @ hash_weights(half)).tolist(), total[usable][varied].tolist(),  # (int64 wraps: a hash)
            exact[varied])


def forget() -> None:
    """A trace ended: its keys let go (another trace's keys, the same program --fixed, must find none of them)."""
    _LAST.clear()
    _SITE[0] = None


def _scaled(back: list, rows: int) -> dict | None:
    """The factor the rows that came back scaled (hash, ratio) share, where two or more of other directions did and it
    is one; else None."""
    ratios = np.asarray([ratio for _, ratio in back], dtype=np.float64)
    scaled = np.abs(ratios - 1) > SCALED
    off, directions = ratios[scaled], np.asarray([key for key, _ in back], dtype=np.int64)[scaled]
    if not (directions != directions[:1]).any() or np.abs(off - off[0]).max() > TOLERANCE * off[0]:
        return None
    return {"factor": round(float(off.mean()), 4), "keys": int(off.size), "found": int(ratios.size), "of": rows}
