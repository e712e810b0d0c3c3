"""Chunked prefill checked: each layer's chunk masks, laid on absolute positions, put together against the mask
the same layer gets when the prompt is prefilled in one pass; the first cell where they differ is named.

Each call's queries and keys sit where its cache put them (details "queries", and "keys" or a ring's "slots",
from maskcli.hf.run.positions): a dynamic cache returns everything so far or a sliding layer's last keys, a
static one its slots from 0. Keys a cache no longer returns are masked in the assembled mask, as attention
cannot see them; slots past the prompt (a static cache's, not yet written) are left out of both.
"""

from __future__ import annotations

import numpy as np


def key_positions(call) -> np.ndarray:
    """The absolute position of each of the call's key columns (-1 for a slot that holds none)."""
    if "slots" in call.details:
        return np.asarray(call.details["slots"], dtype=np.int64)
    k0, k1 = call.details["keys"]
    return np.arange(k0, k1, dtype=np.int64)


def on_positions(call, prompt_len: int) -> np.ndarray:
    """Bool (B, H, Lq, P): the call's mask with its key columns moved to their positions in the prompt."""
    q0, q1 = call.details["queries"]
    keep = np.broadcast_to(call.keep(), call.shape)
    out = np.zeros(call.shape[:2] + (q1 - q0, prompt_len), dtype=bool)
    where = key_positions(call)
    inside = (where >= 0) & (where < prompt_len)
    out[..., where[inside]] = keep[..., np.flatnonzero(inside)]
    return out


def assembled(calls: list, prompt_len: int) -> np.ndarray:
    """Bool (B, H, P, P): the prefill chunks' masks of one layer (their calls in step order) on absolute positions."""
    first = calls[0]
    batch, heads = first.shape[:2]
    out = np.zeros((batch, heads, prompt_len, prompt_len), dtype=bool)
    for call in calls:
        q0, q1 = call.details["queries"]
        out[:, :, q0:q1] = on_positions(call, prompt_len)
    return out


def check(chunked: list, single: list, types: list[str], prompt_len: int, chunks: int, size: int) -> tuple[list[str], bool]:
    """(lines, holds): the chunked run's prefill calls (steps below `chunks`) against the single pass's, layer by layer."""
    lines = []
    for layer, kind in enumerate(types):
        mine = sorted((c for c in chunked if c.details["layer"] == layer and c.step < chunks), key=lambda c: c.step)
        whole = [c for c in single if c.details["layer"] == layer and c.step == 0]
        if len(mine) != chunks or len(whole) != 1:
            lines.append(f"--prefill-chunk {size}: layer {layer} ({kind}) made {len(mine)} prefill calls in chunks and "
                         f"{len(whole)} in one pass: not compared")
            continue
        together = assembled(mine, prompt_len)
        one = on_positions(whole[0], prompt_len)
        if together.shape != one.shape:
            lines.append(f"--prefill-chunk {size}: layer {layer} ({kind}): the chunks cover {together.shape[2:]} "
                         f"positions, the single pass {one.shape[2:]}: not compared")
            continue
        differ = np.argwhere(together != one)
        if len(differ):
            b, h, q, k = (int(x) for x in differ[0])
            lines.append(f"--prefill-chunk {size}: layer {layer} ({kind}): the chunks put together differ from the single-pass "
                         f"prefill in {len(differ)} cells, first at batch row {b}, head {h}, query {q}, key {k}: the chunks "
                         f"{'let it attend' if together[b, h, q, k] else 'mask it'}, one pass {'lets it attend' if one[b, h, q, k] else 'masks it'}")
    holds = not lines
    if holds:
        lines.append(f"--prefill-chunk {size}: in every layer the {chunks} chunks' masks put together equal the single-pass prefill mask")
    return lines, holds
