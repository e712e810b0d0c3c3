"""checks/frameblocks.py (and trace/framebudget.py's frame_blocks, video_input): a video model stated block-causal
over frames against the frames its queries see."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, first, traced

FRAMES = Path(__file__).parent / "data" / "frameblocks"


def test_fastvideo_longcat_dfsft_trains_without_block_causal_mask(tmp_path):
    """FastVideo #1307: LongCatCausalModel (causal_block_size=3, its one module the transformer) never passed
    causal_block_size to the training forward: 6 latent frames of 2x2 tokens attend each other both ways. The first
    cell by a double loop: a key 3 or more frames after the query's (blocks of 3, whatever their alignment)."""
    hits = check_bug(tmp_path, "fastvideo_longcat_dfsft_trains_without_block_causal_mask", "frames-see-later-blocks")
    frame = torch.arange(24) // 4
    assert tuple(hits[0]["cell"]) == first((2, 24, 24), lambda b, q, k: bool(frame[k] - frame[q] >= 3))


def test_selfforcing_block_mask_frames_compared_to_tokens(tmp_path):
    """Written another way: the model keeps its own num_frame_per_block (1), a [B, C, T, H, W] latent patched 2x2
    (C=4 and T=6: only T divides the 24 queries into frames that tile H x W), a bool SDPA mask comparing key frames
    with a block end counted in tokens. The first cell against the torch.tril of frames (the fix's mask); the fix is
    quiet."""
    status, found, report = traced(tmp_path, "selfforcing_block_mask_frames_compared_to_tokens", False, FRAMES)
    assert status == 1, report
    hits = [f for f in found if f["code"] == "frames-see-later-blocks"]
    assert hits and all(f["severity"] == "wrong" for f in hits), report
    frames = torch.ones(6, 6, dtype=torch.bool).tril()
    frame = torch.arange(24) // 4
    buggy = frame[None, :] < ((frame + 1) * 4)[:, None]
    assert tuple(hits[0]["cell"]) == first((2, 24, 24), lambda b, q, k: bool(buggy[q, k] and not frames[frame[q], frame[k]]))
    status, found, report = traced(tmp_path, "selfforcing_block_mask_frames_compared_to_tokens", True, FRAMES)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
