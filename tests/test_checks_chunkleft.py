"""checks/chunkleft.py: a streaming encoder's chunk mask whose left context is not the one its held chunk config
states, caught in the published bug's reproduction (tests/data/bugs) and in a program written another way
(tests/data/chunkleft), quiet on both fixes; the flagged cell against a double loop over positions."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug
from maskcli.checks.chunkleft import _judged

CHUNKLEFT = Path(__file__).parent / "data" / "chunkleft"


def _reference(t: int, n: int, size: int, left: int | None) -> np.ndarray:
    """(T, T) keep of a chunk mask over `n` real frames of `t`: each real frame sees its chunk whole and `left` chunks
    before it (a double loop over positions)."""
    cells = np.zeros((t, t), dtype=bool)
    for q in range(n):
        for k in range(n):
            c, ck = q // size, k // size
            cells[q, k] = ck <= c and (left is None or ck >= c - left)
    return cells


def test_speechbrains_left_context_chunks_subtracted_as_frames_is_found(tmp_path):
    # speechbrain#2140: DCTConfig(chunk_size=4, left_context_size=2) held by encode(); the mask kept 2 frames of the
    # past, not 2 chunks. The reference streaming pass (DCTConfig(chunk_size=4), the whole past) is quiet in both
    found = check_bug(tmp_path, "speechbrain_dynchunk_left_context_chunks_used_as_frames", "chunk-left-context")
    assert len(found) == 1
    # batch row 0's frame 4 (chunk 1) first sees key 2 where the config states key 0
    assert tuple(found[0]["cell"]) == (0, 4, 0)
    assert "left_context_size=2" in found[0]["message"] and "counted in frames, not chunks" in found[0]["message"]


def test_wenet_style_left_chunks_counted_back_from_each_frame_is_found(tmp_path):
    found = check_bug(tmp_path, "wenet_style_left_chunks_counted_per_frame", "chunk-left-context", folder=CHUNKLEFT)
    # chunk_size=3, num_left_chunks=2: frame 7 (chunk 2) should see from frame 0 and sees from 1
    assert tuple(found[0]["cell"]) == (0, 7, 0) and "num_left_chunks=2" in found[0]["message"]


def test_the_reference_chunk_mask_is_quiet_per_row_with_padding_and_its_off_by_a_chunk_kin_are_found():
    held = {"chunk": 4, "left": 1, "unit": "chunks", "said": "cfg"}
    right = np.stack([_reference(14, 14, 4, 1), _reference(14, 10, 4, 1)])
    assert _judged(right, held) is None
    assert _judged(right, {**held, "left": None}) is not None  # (the whole past stated: one chunk back is too few)
    assert _judged(np.stack([_reference(14, 14, 4, None)]), {**held, "left": None}) is None
    assert _judged(np.stack([_reference(14, 14, 4, 2)]), held) is not None  # (a chunk more than stated)
    frames = {"chunk": 4, "left": 8, "unit": "frames", "said": "cfg"}  # (icefall's left_context_frames: 2 chunks)
    assert _judged(np.stack([_reference(14, 14, 4, 2)]), frames) is None
    causal = np.tril(np.ones((14, 14), dtype=bool))[None]  # (no chunk mask: its right edges are not the chunks')
    assert _judged(causal, held) is None
