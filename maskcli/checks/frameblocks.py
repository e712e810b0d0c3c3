"""A video model the program states block-causal over frames whose queries see frames a whole block or more ahead.

Autoregressive video diffusion generates a clip a block of `num_frame_per_block` latent frames at a time (FastVideo's
`causal_block_size`, Self-Forcing's and CausVid's `num_frame_per_block`): the frames of a block attend each other, a
block attends the blocks before it, never one after it. The program states that block where its model or the one
object that wraps it keeps it (trace/framebudget.py's frame_blocks: FastVideo's LongCatCausalModel holds
`_causal_block_size = 3` beside its transformer). The tokens of a frame are read off the model call's 5-D latent
(B, C, T, H, W) or (B, T, C, H, W): T is the axis of the two that divides the queries into frames of a size that
divides H x W (a patch embedding takes square patches of a frame; the channels rarely fit both), where exactly one does.

Whatever the blocks' alignment (CausVid's first frame alone, then blocks), no block holds two frames N or more apart,
so a query that sees a key N or more frames after its own sees the future: wrong (FastVideo #1307:
LongCatCausalModel did not override `_build_distill_input_kwargs`, so the DFSFT training forward never passed
`causal_block_size` and every frame attended every other). Queries sit at the end of the keys (a cache's frames
first). Quiet on cross-attention, where no single frame layout fits, where the clip is one block, and where the
program states no block (a bidirectional model's frames see each other on purpose).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _per_frame(shape: tuple, q_len: int) -> int | None:
    """Tokens per frame of a call with q_len queries over the latent `shape` (B, d1, d2, H, W), where one reading of
    T (d1 or d2) fits; None else."""
    area = shape[3] * shape[4]
    fits = {q_len // t for t in shape[1:3] if t > 0 and q_len % t == 0 and area % (q_len // t) == 0}
    return fits.pop() if len(fits) == 1 else None


def future_frames(run: Run) -> list:
    """Self-attention calls of a model stated block-causal over blocks of N frames whose query sees a key N or more
    frames after its own."""
    found = []
    for top in run.tops:
        said = next((one.fields["frame_block"] for one in top.stated if "frame_block" in one.fields), None)
        shape = top.arguments.get("video_input")
        if said is None or not isinstance(shape, tuple) or len(shape) != 5:
            continue
        frames, source = said
        done = {}
        for call in run.made_by(top):
            q_len, k_len = call.shape[2], call.shape[3]
            per = _per_frame(shape, q_len)
            if cross(call) or per is None or k_len % per or k_len // per <= frames:
                continue
            key = (call.mask, call.shape)
            if key not in done:
                done[key] = _finding(call, per, frames, source)
            if done[key] is not None:
                found.append((call, done[key]))
    return found


def _finding(call, per: int, frames: int, source: str) -> Finding | None:
    cells = keep(call)
    if cells is None:
        return None
    q_len, k_len = call.shape[2], call.shape[3]
    q_frame = (k_len - q_len + np.arange(q_len)) // per
    k_frame = np.arange(k_len) // per
    ahead = k_frame[None, :] - q_frame[:, None] >= frames  # (Lq, Lk)
    bad = cells.any(axis=1) & ahead[None]
    if not bad.any():
        return None
    b, q, k = (int(x) for x in np.argwhere(bad)[0])
    later = int(k_frame[k] - q_frame[q])
    return Finding("frames-see-later-blocks", (
        f"batch row {b}: query {q} (frame {int(q_frame[q])}) sees key {k} (frame {int(k_frame[k])}), "
        f"{later} frame{'s' * (later != 1)} later, while {source} states blocks of {frames} frame{'s' * (frames != 1)}, causal from "
        f"block to block ({per} tokens a frame, {k_len // per} frames here): a later block's keys are visible "
        f"({int(bad.sum())} such cells; the block-causal mask never reached this attention, or was built in other "
        f"units?)"),
        expected=f"block-causal over blocks of {frames} frames", source=source, cell=(b, q, k))


RULES = (
    Rule("frames-see-later-blocks", "wrong", "steps", "a video model stated block-causal over blocks of N frames "
         "(num_frame_per_block, causal_block_size) whose query sees a key N or more frames after its own (FastVideo "
         "#1307: the DFSFT training forward never passed causal_block_size)", future_frames),
)
