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


def _never_rolled(blocks: int, block_tokens: int) -> list[int]:
    """Keys each block's queries see over a cache that keeps every earlier frame (a plain loop over the blocks)."""
    return [sum(block_tokens for _ in range(b + 1)) for b in range(blocks)]


def test_fastvideo_causal_wan_kv_cache_sink_and_window_from_wrong_frame_seqlen(tmp_path):
    """hao-ai-lab/FastVideo#1355 (commit 63030cf), written blind: the denoising stage read local_attn_size off
    `transformer.model` (absent: -1) and sized the cache for 21 frames, so it never rolled, while every attention
    layer states local_attn_size=4, sink_size=1; the stage states frame_seq_length=4. A block of 2 frames (8 tokens)
    then sees every earlier frame: the last block 32 keys, past 4 x 4."""
    hits = check_bug(tmp_path, "fastvideo_causal_wan_kv_cache_sink_and_window_from_wrong_frame_seqlen",
                     "frames-over-cache")
    seen = _never_rolled(blocks=4, block_tokens=2 * 4)
    over = sorted(int(f["message"].split(" sees ")[1].split()[0]) for f in hits)
    assert over[-1] == max(seen) == 32 and all(n > 4 * 4 for n in over)
    assert all("local_attn_size=-1" in f["source"] and "never rolls" in f["message"] for f in hits)


def test_pipeline_window_read_off_wrong_key_cache_never_rolls(tmp_path):
    """Written another way: a pipeline reads its window off a dict key the config lacks (-1) and sizes heads-first
    caches for the whole video; every layer states local_attn_size=3, no sink; the pipeline tokens_per_frame=4;
    hand-written softmax, batch of 3, one frame a block. Its fix asks the model: quiet."""
    hits = check_bug(tmp_path, "pipeline_window_read_off_wrong_key_cache_never_rolls", "frames-over-cache", FRAMES)
    seen = _never_rolled(blocks=6, block_tokens=4)
    over = sorted({int(f["message"].split(" sees ")[1].split()[0]) for f in hits})
    assert over == [n for n in seen if n > 3 * 4] == [16, 20, 24]
