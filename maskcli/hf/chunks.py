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
    """(lines, holds): the chunked run's prefill calls (steps below `chunks`) against the single pass's, layer by layer.

    A layer that attends n times a forward (DiffLlama: once per half of the values) has n calls at each chunk and n
    in one pass: its k-th calls are put together and compared. A layer with no attention call in either run (linear
    attention, a convolution: nothing to mask) is said once, not failed."""
    lines, silent = [], []
    for layer, kind in enumerate(types):
        # (a stable sort: a step's calls stay in the order they were made)
        mine = sorted((c for c in chunked if c.details["layer"] == layer and c.step < chunks), key=lambda c: c.step)
        whole = [c for c in single if c.details["layer"] == layer and c.step == 0]
        if not mine and not whole:
            silent.append((layer, kind))
            continue
        per_step = [[c for c in mine if c.step == step] for step in range(chunks)]
        if not whole or any(len(calls) != len(whole) for calls in per_step):
            lines.append(f"--prefill-chunk {size}: layer {layer} ({kind}) made {'/'.join(str(len(c)) for c in per_step)} "
                         f"calls at its {chunks} chunks and {len(whole)} in one pass: not compared")
            continue
        for nth, one_call in enumerate(whole):
            lines += _compared([calls[nth] for calls in per_step], one_call, layer, kind, prompt_len, size,
                               f"its call {nth + 1} of {len(whole)} in a forward" if len(whole) > 1 else "")
    holds = not lines
    if holds:
        lines.append(f"--prefill-chunk {size}: in every layer{' that attends' if silent else ''} the {chunks} chunks' masks put "
                     "together equal the single-pass prefill mask")
    if silent:
        from maskcli.text import spans

        kinds = ", ".join(dict.fromkeys(kind for _, kind in silent))
        layers = (f"layers {spans([layer for layer, _ in silent])} ({kinds}) make" if len(silent) > 1
                  else f"layer {silent[0][0]} ({kinds}) makes")
        lines.append(f"--prefill-chunk {size}: {layers} no attention call: no mask to compare")
    return lines, holds


def _compared(mine: list, whole, layer: int, kind: str, prompt_len: int, size: int, which: str) -> list[str]:
    """[] where the chunk calls `mine` put together equal the single pass's call `whole`, else the line that says where not."""
    together = assembled(mine, prompt_len)
    one = on_positions(whole, prompt_len)
    said = f"--prefill-chunk {size}: layer {layer} ({kind}){', ' + which if which else ''}"
    if together.shape != one.shape:
        return [f"{said}: the chunks cover {together.shape[2:]} positions, the single pass {one.shape[2:]}: not compared"]
    differ = np.argwhere(together != one)
    if not len(differ):
        return []
    b, h, q, k = (int(x) for x in differ[0])
    return [f"{said}: the chunks put together differ from the single-pass prefill in {len(differ)} cells, first at batch "
            f"row {b}, head {h}, query {q}, key {k}: the chunks {'let it attend' if together[b, h, q, k] else 'mask it'}, "
            f"one pass {'lets it attend' if one[b, h, q, k] else 'masks it'}"]
