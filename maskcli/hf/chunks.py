"""Chunked prefill checked: each layer's chunk masks, laid on absolute positions, put together against the mask
the same layer gets when the prompt is prefilled in one pass; the first cell where they differ is named.

A chunk's queries follow the chunks before it; its keys are the last Lk positions up to its last query (what a
dynamic cache returns: everything so far, or a sliding layer's last keys). Keys a cache no longer returns are
masked in the assembled mask, as attention cannot see them.
"""

from __future__ import annotations

import numpy as np


def assembled(calls: list, prompt_len: int) -> np.ndarray:
    """Bool (B, H, P, P): the prefill chunks' masks of one layer (their calls in step order) on absolute positions."""
    first = calls[0]
    batch, heads = first.shape[:2]
    out = np.zeros((batch, heads, prompt_len, prompt_len), dtype=bool)
    start = 0
    for call in calls:
        q_len, k_len = call.shape[2:]
        end = start + q_len
        out[:, :, start:end, end - k_len:end] = np.broadcast_to(call.keep(), call.shape)
        start = end
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
        one = np.broadcast_to(whole[0].keep(), whole[0].shape)
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
