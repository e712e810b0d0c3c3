"""checks/framebudget.py (and trace/framebudget.py): a video model's queries against the rolling KV cache of
`local_attn_size` frames it states."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, traced

FRAMES = Path(__file__).parent / "data" / "framebudget"


def _seen(query: int, rolling: int, sink: int = 2, block: int = 6) -> int:
    """Keys a query of the fused block-causal + sink forward sees, by a plain loop over the keys: its block's end,
    the sink columns and a window of `rolling` keys before that end."""
    end = (query // block + 1) * block
    return sum(1 for k in range(18) if k < end and (k < sink or k >= end - rolling))


def test_fastvideo_block_causal_sink_rolling_window_one_frame_too_wide(tmp_path):
    """FastVideo dad62979e: rolling_window_tokens = local_attn_size * frame_seqlen counts the sink frame twice; the
    plan (a dataclass at the main module's top level) keeps 4 frames of 2 tokens, the sink among them."""
    hits = check_bug(tmp_path, "fastvideo_block_causal_sink_rolling_window_one_frame_too_wide", "frames-over-cache")
    counts = [_seen(q, rolling=4 * 2) for q in range(18)]
    b, q, k = hits[0]["cell"]
    assert counts[q] == max(counts) > 4 * 2 and q == counts.index(max(counts))
    assert k == next(k for k in range(2, 18) if k >= (q // 6 + 1) * 6 - 4 * 2)  # the oldest window key, past the sink
    assert max(_seen(q, rolling=(4 - 1) * 2) for q in range(18)) <= 4 * 2  # the fix's window keeps the budget


def test_causvid_rolling_cache_keeps_sink_plus_local_frames(tmp_path):
    """Written another way: frame-by-frame decode over a cache of its own (a list of frames), the config a dict the
    model holds, a batch of two, SDPA given no mask; the buggy eviction keeps the sink plus local_attn_size frames
    (16 keys of 4 tokens a frame, past the 12 of 3 frames). Its fix keeps 3 frames: quiet (and its frames, each
    attended both ways, are not called a causal layer's prompt attending both ways)."""
    status, found, report = traced(tmp_path, "causvid_rolling_cache_keeps_sink_plus_local_frames", False, FRAMES)
    assert status == 1, report
    hits = [f for f in found if f["code"] == "frames-over-cache"]
    assert hits and all(f["severity"] == "wrong" for f in hits), report
    assert "(4 frames of 4 tokens)" in hits[0]["message"] and tuple(hits[0]["cell"]) == (0, 0, 4), report
    status, found, report = traced(tmp_path, "causvid_rolling_cache_keeps_sink_plus_local_frames", True, FRAMES)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
