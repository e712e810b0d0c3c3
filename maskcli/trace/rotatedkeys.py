"""Which key each query was rotated like: a call's queries' (cos, sin) factors against its keys' (trace/rotated.py).

A cached decode that keeps its keys unrotated rotates every key again at each step (keras-hub's
`RotaryEmbedding(key)` over the whole cache) beside the step's queries (`RotaryEmbedding(query, start_index=...)`):
two rotations of one call, told apart by their rows (the queries' and the keys'). A query and a key rotated at one
position have the same angle in every rotary pair, whatever the frequencies are, so no table or frequency is needed:
each query's angles (atan2 of its sin and cos factors at the columns rotated.py keeps) are compared with each key's,
and the keys that agree in every column are the ones rotated where that query was. Said only where each side is one
(cos, sin) pair whose squares sum to 1; O(queries x keys) a call, so only for a few queries over their keys.
checks/rotatedkeys.py holds each query to the key its mask places it at.

Also (`flat`): a (cos, sin) pair of one row broadcast over as many tokens as the call's queries or keys (not its batch
or heads): every one of those tokens rotated at one position (ring-attention-pytorch's table sized by the heads axis,
one head, so one row for every token), which checks/rotatedkeys.py holds against a causal mask over them.

And (`shifted`): the factors of the call's own tokens (as many rows as its queries) that are two (cos, sin) pairs, not
one: its queries and its new keys rotated with tables whose angles differ, in every column kept, by one amount for every
token of a batch row (one shift of positions: mlx-lm#1806 rotated Gemma 3n's queries after the cache's offset had
advanced past the keys it had just rotated). Two rotations of one axis that differ from token to token (an image's
rows and columns) are not one shift and are left alone.
"""

from __future__ import annotations

import math

import torch

TOLERANCE = 1e-2  # radians: a position apart turns the fastest pair 1 rad; bf16 factors round angles by ~5e-3
MAX_CELLS = 1 << 20  # queries x keys compared a call


def kept(entry: tuple) -> torch.Tensor:
    """A factor's kept columns (rotated.py's entry), as double on the CPU (no mode sees the copy)."""
    with torch._C.DisableTorchFunction():
        return entry[2][..., entry[1]].double().cpu()


def _angles(entries: list) -> list:
    """The (planes, L, columns) angles of each (cos, sin) pair among `entries`, in the order they were multiplied."""
    found, i = [], 0
    while i + 1 < len(entries):
        (shape, cols, *_), (other, *_) = entries[i], entries[i + 1]
        if shape == other:
            cos, sin = kept(entries[i]), kept(entries[i + 1])
            if float((cos * cos + sin * sin - 1).abs().max()) < 1e-3:
                found.append(torch.atan2(sin, cos).reshape(-1, shape[-2], len(cols)))
                i += 2
                continue
        i += 1
    return found


def note(details: dict, queried: list, keyed: list) -> None:
    """details["rotated_like"] = {"first": (planes, Lq) the first key column rotated where each query was (-1: none),
    "count": how many are}: where the queries' factors and the keys' are one pair each."""
    ours, theirs = _angles(queried), _angles(keyed)
    if len(ours) != 1 or len(theirs) != 1:
        return
    q, k = ours[0], theirs[0]
    planes = max(q.shape[0], k.shape[0])
    if q.shape[-1] != k.shape[-1] or any(x.shape[0] not in (1, planes) for x in (q, k)) \
            or planes * q.shape[1] * k.shape[1] > MAX_CELLS:
        return
    apart = torch.remainder(q[:, :, None, :] - k[:, None, :, :] + math.pi, 2 * math.pi) - math.pi
    same = (apart.abs() < TOLERANCE).all(dim=-1)  # (planes, Lq, Lk)
    count = same.sum(dim=-1)
    first = torch.where(count > 0, same.to(torch.int8).argmax(dim=-1), -1)
    details["rotated_like"] = {"first": first.tolist(), "count": count.tolist()}


def flat(details: dict, entries: list, shape: tuple) -> None:
    """details["rotated_flat"]: the token counts (the call's queries' or keys') a (cos, sin) pair of one rotation was
    broadcast over, where that count is neither the batch's nor the heads'."""
    batch, heads, q_len, k_len = (int(n) for n in shape)
    counts = set()
    for i in range(len(entries) - 1):
        first, second = entries[i], entries[i + 1]
        if first[0] == second[0] and first[4] == second[4] and _angles([first, second]):
            counts.update(n for n in first[4] if n in (q_len, k_len) and n not in (batch, heads) and n > 1)
    if counts:
        details["rotated_flat"] = sorted(counts)


def _distinct(entries: list) -> list:
    """Each factor's kept columns once, in the order first multiplied (a table multiplied into queries and keys alike
    is one)."""
    found: list = []
    for entry in entries:
        cols = kept(entry)
        if not any(seen.shape == cols.shape and bool(torch.allclose(seen, cols, atol=1e-5)) for seen in found):
            found.append(cols)
    return found


def shifted(details: dict, entries: list) -> None:
    """details["rotated_shift"] = {"rows": the tokens}: where the factors of
    the call's own tokens are two (cos, sin) pairs, each token of a batch row turned by one same angle from one to the
    other in every column (a shift of positions), at two tokens or more."""
    tables = _distinct(entries)
    if len(tables) != 4 or len({t.shape for t in tables}) != 1 or tables[0].shape[-2] < 2:
        return
    angles = []
    for cos, sin in ((tables[0], tables[1]), (tables[2], tables[3])):
        if float((cos * cos + sin * sin - 1).abs().max()) > 1e-3:
            return
        angles.append(torch.atan2(sin, cos).reshape(-1, cos.shape[-2], cos.shape[-1]))
    apart = torch.remainder(angles[1] - angles[0] + math.pi, 2 * math.pi) - math.pi  # (planes, L, columns)
    drift = torch.remainder(apart - apart[:, :1] + math.pi, 2 * math.pi) - math.pi
    if float(apart.abs().max()) > 10 * TOLERANCE and float(drift.abs().max()) < TOLERANCE:
        details["rotated_shift"] = {"rows": int(tables[0].shape[-2])}
