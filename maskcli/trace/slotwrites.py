"""The key slots a step wrote into a cache buffer it hands attention whole, read off the buffer itself.

A cache the program preallocates (vLLM's and vllm-ascend's paged `key_cache`, gpt-fast's KVCache, a drafter's
buffer) is handed to attention as the same tensor at every step of a call site, each step writing its new tokens'
keys into it first (`key_cache[rows, :, positions] = k`, slot_mapping). What a step wrote is where the buffer
changed since the site's last call: each slot's first dimension in head 0, of K and of V (a write changes every
head of a slot), is kept per buffer (its storage address and shape), and the next call over that buffer compares its
own. Where
every batch row changed in exactly the call's query count of slots, one run [p, p + Lq), those are the slots the
step's queries wrote their keys to: their positions, stated by the program's own write (details "written": per row
[p, p + Lq)). checks/cache.py holds each query's keys against it: a query sees no slot past its own.

Read only on the CPU, for a 4-D K of more keys than queries (a cache) that was written in place (its version counter
past 0: a tensor made anew each step, a dynamic cache's cat, is not read at all); a buffer that rolls (every slot
changed), another address or shape, or a step that wrote nothing (a cross-attention's memory) records nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.hostview import host

KEPT = 64  # buffers whose checksums are kept at once (more: the oldest goes)
GAPS = 4096  # empty slots kept a row (checks/cache.py says the first it sees, and counts those)
_SEEN: dict = {}  # (storage address, shape) -> (B, S) checksums of K and of V at that buffer's last call


def written(q_len: int, k: torch.Tensor, v: torch.Tensor, k_shape: tuple) -> dict:
    """{"written": [[p, p + Lq], ...] per batch row} where the buffer K (and V) changed in exactly those slots since
    its last call, else {}; the checksums kept for the next call."""
    if len(k_shape) != 4 or q_len >= k_shape[2]:
        return {}
    try:
        if k._version == 0:
            return {}  # (never written in place: a new tensor each step, a dynamic cache's cat; no buffer to compare)
    except RuntimeError:
        pass  # (an inference tensor keeps no version counter: read it)
    if not k.is_cpu or type(k) is not torch.Tensor or k.dtype not in _FLOATS or v.dim() != 4 \
            or tuple(v.shape[:3]) != tuple(k_shape[:3]):
        return {}
    try:
        with torch.no_grad():  # (head 0's first dimension of each slot: a write changes every head of it)
            sums = np.stack((_column(k), _column(v)))  # (2, B, S)
        key = (k.data_ptr(), k_shape, v.data_ptr())
    except Exception:  # noqa: BLE001 - a tensor not read here (fake, meta, a subclass's) states no write
        return {}
    before = _SEEN.pop(key, None)
    if len(_SEEN) >= KEPT:
        _SEEN.pop(next(iter(_SEEN)))
    _SEEN[key] = sums
    if before is None or before.shape != sums.shape:
        return {}
    changed = (before != sums).any(axis=0)  # (B, S)
    runs = []
    for row in changed:
        at = np.flatnonzero(row)
        if at.size != q_len or at[-1] - at[0] != q_len - 1:
            return {}  # (a row that wrote no slot, or other slots than its queries: nothing stated)
        runs.append([int(at[0]), int(at[-1]) + 1])
    return {"written": runs, **_gaps(sums, runs)}


def _gaps(sums: np.ndarray, runs: list) -> dict:
    """{"gaps": per row the slots before its written run that hold nothing (K's and V's cells 0) after one that holds a
    key} where any row has one: slots a prefill skipped (WhisperSpeech's prompt never written into its cache); a row's
    leading zeros (its left padding under bias-free projections) are no gap."""
    zero = (sums == 0).all(axis=0)  # (B, S)
    gaps = []
    for row, (start, _) in zip(zero, runs):  # (a row at a time, the slots in numpy: at most GAPS of them kept a row)
        held = np.flatnonzero(~row[:start])
        empty = np.flatnonzero(row[:start])
        gaps.append(empty[empty > held[0]][:GAPS].tolist() if held.size else [])
    return {"gaps": gaps} if any(gaps) else {}


def forget() -> None:
    """A trace ended: the buffers' checksums let go (another trace's buffer may come to the same address and shape,
    and its first call must compare with nothing)."""
    _SEEN.clear()


def _column(t: torch.Tensor) -> np.ndarray:
    """A copy of head 0's first dimension of every slot of a 4-D tensor, (B, S), as float32 or float64 cells."""
    if t.dtype == torch.bfloat16:
        return t[:, 0, :, 0].float().numpy().copy()
    return host(t)[:, 0, :, 0].copy()


_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
