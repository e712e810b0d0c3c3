"""The tokens a pooled query holds, against the keys it attends: one query per bucket, the mean of the keys' own
sequence shifted right.

A shortening model (an hourglass, a funnel) pools its sequence in buckets of s and resamples each pooled token with
one query over the s tokens of its bucket: queries `(b n) 1 d`, keys `(b n) s d`, a bucket per batch row. An
autoregressive one shifts the sequence right by s - 1 first, so bucket n pools tokens n·s - s + 1 .. n·s, the ones
before the first position that reads it. The kernel's mask cannot say which tokens the query pooled: its causal
alignment puts the one query at its bucket's last key. The values can: at a call of a module that states itself causal
(sites.py's module_causal), the program's frames (walk.py's `held` ones) are read for a one-token query per batch
row, `(R, 1, D)`, and the keys' source beside it, `(R, s, D)` buckets of one or more sequences (a view of a
`(B, N·s, D)` sequence says B; a copy, `unfold` then a permute, is read as each B that divides R): where the query is
the mean of each bucket after its sequence is shifted right by k (zeros before its start), it pooled the tokens up to
k before its bucket's last key (the least such k; 0: its own bucket):
details["pooled_shift"] = {"shift": k, "size": s, "rows": R, "keys": name, "query": name}; checks/poolspan.py holds
it against the call's shape and mask (hourglass-transformer-pytorch d7dc1e0: the pooled token of the shifted sequence
attends the unshifted bucket `x_residual`). Cheap: a scan of a few frames' locals at a causal module's call, numpy
means only where both tensors are there.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

MOST = 1 << 20  # sequence cells read at most
BUCKET = 64  # tokens of a bucket at most
HELD = 64  # (query, keys) pairs whose shift is remembered
_SEEN: dict = {}  # (ids and versions of the pair) -> (weak refs to both, its shift or None)
FRAMES = 6  # program frames looked at, innermost first


def note(details: dict, walked) -> None:
    """details["pooled_shift"] at a call of a module that states itself causal, where a program frame holds the keys'
    bucketed source and a one-token query per bucket that is the mean of its buckets after a shift (k = 0: its own
    bucket). The call's shape is checks/poolspan.py's to hold against `rows` and `size`."""
    if walked is None or "module_causal" not in details:
        return
    keys, queries, seen = [], [], set()
    for frame, _ in walked.held[:FRAMES]:
        for name, value in frame.f_locals.items():
            if not isinstance(value, torch.Tensor) or id(value) in seen or value.dim() != 3 \
                    or value.shape[0] < 2 or not value.is_floating_point():
                continue
            seen.add(id(value))
            if value.shape[1] == 1:
                queries.append((name, value))
            elif _bucketed(value):
                keys.append((name, value))
    for key_name, bucket in keys:
        buckets = None
        for query_name, query in queries:
            if query.shape[0] != bucket.shape[0] or query.shape[2] != bucket.shape[2]:
                continue
            key = (id(query), query._version, id(bucket), bucket._version)
            held = _SEEN.get(key)
            if held is None or held[0]() is not query or held[1]() is not bucket:  # (the same two tensors at every
                if buckets is None:  # layer of a call: read once; an id reused by another tensor is read again)
                    buckets = bucket.detach().cpu().numpy().astype(np.float64)  # (R, s, D)
                if len(_SEEN) > HELD:
                    _SEEN.clear()
                found = _shift(buckets, query.detach().cpu().numpy().astype(np.float64)[:, 0], _sequences(bucket))
                held = _SEEN[key] = (weakref.ref(query), weakref.ref(bucket), found)
            shift = held[2]
            if shift is not None:
                details["pooled_shift"] = {"shift": shift, "size": int(bucket.shape[1]), "rows": int(bucket.shape[0]),
                                           "keys": key_name, "query": query_name}
                return


def _sequences(t: torch.Tensor) -> tuple[int, ...]:
    """The numbers of sequences the buckets of `t` (R, s, D) may be cut from, in order: its base's batch where it is
    a view of a (B, N·s, D) sequence; else each divisor of R (a copy, `unfold` then a permute, says no more)."""
    base, rows = t._base, t.shape[0]
    if base is not None and base.dim() == 3 and base.numel() == t.numel() and base.shape[2] == t.shape[2]:
        return (int(base.shape[0]),)
    return tuple(b for b in range(1, rows + 1) if rows % b == 0)


def _bucketed(t: torch.Tensor) -> bool:
    """`t` (R, s, D) may be a sequence's buckets: several rows of a few tokens, small enough to read."""
    return 1 < t.shape[1] <= BUCKET and t.numel() <= MOST


def _shift(buckets: np.ndarray, query: np.ndarray, sequences: tuple[int, ...]) -> int | None:
    """The least k in 0 .. s - 1 for which `query` (R, D) is the mean of each bucket of `buckets` (R, s, D) after
    the sequences they cut (B of them, of R / B buckets each) are shifted right by k, zeros before each start. The
    last bucket is tried first (O(s·D) a shift: it starts no sequence unless each bucket is one); the whole only where
    it agrees."""
    rows, size, d = buckets.shape
    scale = max(float(np.abs(query).max()), 1.0)
    close = lambda a, b: float(np.abs(a - b).max()) <= 1e-4 * scale  # noqa: E731 - (np.allclose costs 10 times this)
    for k in range(size):
        alone = np.zeros((size, d))
        alone[k:] = buckets[-1, :size - k]
        after = alone.copy()
        after[:k] = buckets[-2, size - k:]
        for b in sequences:
            if not close((alone if b == rows else after).mean(axis=0), query[-1]):
                continue
            sequence = buckets.reshape(b, rows // b * size, d)
            moved = np.zeros_like(sequence)
            moved[:, k:] = sequence[:, :sequence.shape[1] - k]
            if close(moved.reshape(rows, size, d).mean(axis=1), query):
                return k
    return None
