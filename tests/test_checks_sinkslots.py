"""checks/sinkslots.py (and trace/sinkslots.py): a rolling KV cache with sinks whose kernel keys were sliced past the
sink slots the program states."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug

SINKS = Path(__file__).parent / "data" / "sinkslots"


def _slices(size: int, window: int, sink: int, new: int, calls: int) -> set[tuple[int, int]]:
    """(start, end) of each window a rolling cache of `size` slots hands the kernel, sliced to its last `window` slots,
    where it leaves out the `sink` first slots: a plain loop over the calls, evicting past the sink when full."""
    filled, found = 0, set()
    for _ in range(calls):
        if filled + new > size:
            filled -= filled + new - size
        filled += new
        start = max(0, filled - window)
        if start >= sink:
            found.add((start, filled))
    return found


def _spans(hits: list[dict]) -> set[tuple[int, int]]:
    """(start, end) of the keys each finding names ("slots A-B of a cache buffer")."""
    spans = set()
    for f in hits:
        a, b = f["message"].split("slots ")[1].split()[0].split("-")
        spans.add((int(a), int(b) + 1))
    return spans


def test_lightx2v_lingbot_fast_kv_cache_never_rolls_sink_dropped(tmp_path):
    """ModelTC/LightX2V#1008 (commit 90457e8), written blind: the lingbot cache is sized for the whole video (8 frames
    of 4 tokens) with local_attn_size=4 and sink_size=1 set, so it never rolls and the slice to the last 16 slots
    drops the sink frame (slots 0-3). The fix sizes it 4 x 4: quiet."""
    hits = check_bug(tmp_path, "lightx2v_lingbot_fast_kv_cache_never_rolls_sink_dropped", "sink-left-out")
    # each segment's two denoising steps and its rerun write the same slots again (current_end == global_end)
    assert _spans(hits) == _slices(size=32, window=16, sink=4, new=8, calls=4) == {(8, 24), (16, 32)}
    assert all("sink_size=1, frame_seq_length=4" in f["source"] for f in hits)
    assert _slices(size=16, window=16, sink=4, new=8, calls=4) == set()  # the fix's slices keep slot 0


def test_longlive_cache_sized_sink_plus_window_slice_drops_sink(tmp_path):
    """Written another way: a block's own (B, L, H, D) buffers sized sink + local_attn_size frames (4 x 3 slots),
    sliced to the last 3 frames, one frame a step, batch of 2, the sink stated on the attention module. Its fix
    sizes the buffer 3 frames: quiet."""
    hits = check_bug(tmp_path, "longlive_cache_sized_sink_plus_window_slice_drops_sink", "sink-left-out", SINKS)
    assert _spans(hits) == _slices(size=12, window=9, sink=3, new=3, calls=7) == {(3, 12)}
