"""Keys the program zeroed in K (trace/zerokeys.py), read as its own statement of which keys are padding.

A padding mask named as padding (`padding_mask`: True = padding by name) may hold True at the real tokens (Dia's
`padding_mask = text != pad`). Where, in every padded row, the keys that reading calls real are exactly the keys the
program zeroed in K before the call (Dia's `k.masked_fill(~padding_mask, 0)`), the program states the other reading:
its mask is a keep mask, and a kernel that keeps those keys' complement keeps its real keys (held.py's
padding-only-attended is quiet then). So does the program's holding the very same rows, elsewhere in the run, under a
name of the other way round (keras-io's translation example: the encoder's `mask`, 1 = real, handed to the decoder as
`encoder_outputs_padding_mask`): its names disagree, so neither is a statement the kernel's mask contradicts.

So does a decode step behind a cache: the token it feeds is real, so a reading that calls every padded row's own
query key padding is not the program's (mesh-transformer-jax's GPT-J decode: `attention_mask = arange(length) <
masked_tokens`, True at the left padding its bias fills, read by its name as True = real).
"""

from __future__ import annotations

import numpy as np


def zeroed_as_real(call, real: np.ndarray, padded: np.ndarray, at: int) -> bool:
    """Whether the call's keys zeroed in K are, in each padded row (`padded`: bool (rows,)), exactly those `real`
    (bool (rows, n), the keys from `at` on) calls real: the reading turned against what the program zeroed."""
    zero = call.details.get("zero_keys")
    if not isinstance(zero, np.ndarray) or zero.ndim != 2 or zero.shape[0] not in (1, real.shape[0]):
        return False
    zero = np.broadcast_to(zero, (real.shape[0], zero.shape[1]))[:, at:at + real.shape[1]]
    return zero.shape == real.shape and bool(np.array_equal(zero[padded], real[padded]))


def own_called_padding(run, call, real: np.ndarray, padded: np.ndarray, at: int) -> bool:
    """Whether the call is a step behind a cache (fewer queries than keys, its keys' columns positions, after a pass of
    more queries at its site) whose queries' own keys `real` (bool (rows, n), the keys from `at` on) calls padding in
    every padded row: the reading turned. (A first call of one query over more keys is no step: Star-Transformer's
    relay node, its own key first.)"""
    q_len, k_len = call.shape[2:]
    if q_len >= k_len or not padded.any() or call.step == 0 or \
            not any(c.index < call.index and c.shape[2] > q_len for c in run.sites().get(call.where, ())):
        return False
    _, own, positions = run.placed(call)
    columns = own - at
    if not positions or not len(columns) or columns.min() < 0 or columns.max() >= real.shape[1]:
        return False
    return not real[padded][:, columns].any()


def named_other_way(run, held: dict) -> bool:
    """Whether the run holds `held`'s rows (a "keep" or "pad" table) at some call under a name of the other way round;
    or another table named as padding the way `held` is (`decoder_padding_mask` beside `padding_mask`), held elsewhere
    under a name of the other way round: the program's padding names follow the other convention (KerasHub's
    `padding_mask`, True = real, handed on as `mask`)."""
    other = {"keep": "pad", "pad": "keep"}.get(held["kind"])
    if other is None:
        return False
    helds = [one for call in (*run.calls, *run.cross) for one in call.details.get("held_padding") or ()]
    turned = {(one["rows"].shape, one["rows"].tobytes()) for one in helds if one["kind"] == other}
    if not turned:
        return False
    family = held["kind"] == "pad" and held["name"].endswith("padding_mask")
    same = [held] + [one for one in helds if family and one["kind"] == "pad" and one["name"].endswith("padding_mask")]
    return any((one["rows"].shape, one["rows"].tobytes()) in turned for one in same)
