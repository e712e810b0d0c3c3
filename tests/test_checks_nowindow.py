"""checks/nowindow.py (and trace/nowindow.py): a module stating window_size=None whose attention cuts each map it
was handed into windows."""

from __future__ import annotations

from pathlib import Path

from checkbugs import traced

BLIND = Path(__file__).parent / "data" / "blind"
NOWINDOW = Path(__file__).parent / "data" / "nowindow"


def _first_unseen(height: int, width: int, wh: int, ww: int) -> tuple[int, int]:
    """The first (query, key) of one map, its tokens in the order its window partition lays them (windows row-major,
    tokens row-major in each), that a query does not see though the None window covers the whole map: a double loop
    over the map's cells and over those positions."""
    order = sorted(((r // wh) * (width // ww) + c // ww, r % wh, c % ww, r, c)
                   for r in range(height) for c in range(width))
    window = [w for w, *_ in order]
    for q in range(len(order)):
        for k in range(len(order)):
            if window[q] != window[k]:  # (the whole map expected: every pair seen)
                return q, k
    raise AssertionError("every pair seen")


def _hits(found: list, code: str = "none-window-split") -> list:
    return [f for f in found if f["code"] == code]


def test_vit_pytorch_scalable_vit_none_window_square_on_rectangular_map(tmp_path):
    """lucidrains/vit-pytorch c2b2db2: `wsz = default(wsz, height)` cut the 8x16 and 4x8 maps into square windows of
    their height; the fix (`default(wsz, width)` for the other side) attends each map whole: quiet. Suspicious: that a
    None window is the whole map is the module's own convention."""
    name = "vit_pytorch_scalable_vit_none_window_square_on_rectangular_map"
    status, found, report = traced(tmp_path, name, False, BLIND)
    hits = _hits(found)
    assert len(hits) == 2 and all(h["severity"] == "suspicious" for h in hits), report
    assert [tuple(h["cell"]) for h in hits] == [(0, *_first_unseen(8, 16, 8, 8)), (0, *_first_unseen(4, 8, 4, 4))]
    assert "self.window_size=None of InteractiveWindowedSelfAttention" in hits[0]["message"]
    status, found, report = traced(tmp_path, name, True, BLIND)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_hier_vit_global_stage_none_window_tall_map(tmp_path):
    """Written another way: channels last (B, H, W, C), SDPA with its heads, a tall 8x4 map cut by `min(H, W)` into two
    4x4 windows; the stage before it states its 4x4 windows (an int) and is not flagged. The fix is quiet."""
    name = "hier_vit_global_stage_none_window_tall_map"
    status, found, report = traced(tmp_path, name, False, NOWINDOW)
    hits = _hits(found)
    assert len(hits) == 1 and hits[0]["severity"] == "suspicious", report
    assert tuple(hits[0]["cell"]) == (0, *_first_unseen(8, 4, 4, 4))
    assert "stages.1.attn" in report and "stages.0" not in hits[0]["message"]
    status, found, report = traced(tmp_path, name, True, NOWINDOW)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_hier_vit_none_window_whole_wide_map(tmp_path):
    """Quiet: windows an int states in the first stage, a None window that attends the whole wide map in the last."""
    status, found, report = traced(tmp_path, "hier_vit_none_window_whole_wide_map", False, NOWINDOW)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_seq_local_attention_none_window_default_chunk_bmm(tmp_path):
    """Written another way: a 1-D sequence (B, N, D), heads folded into the batch for torch.bmm, a hand softmax, a None
    window chunked by a default quarter of the sequence; the layer before it states its window of 8 (an int) and is
    not flagged. The cell is the first pair a double loop over the sequence's positions finds in two chunks."""
    name = "seq_local_attention_none_window_default_chunk_bmm"
    status, found, report = traced(tmp_path, name, False, NOWINDOW)
    hits = _hits(found)
    assert len(hits) == 1 and hits[0]["severity"] == "suspicious", report
    assert tuple(hits[0]["cell"]) == (0, *_first_unseen(1, 32, 1, 8))  # (one row of 32: chunks of 8)
    assert "2 heads folded in" in hits[0]["message"]
    status, found, report = traced(tmp_path, name, True, NOWINDOW)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
