"""Statistics at any length: against sums of the dense cells, and against closed forms at a million tokens."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings

import definitions as ref
from maskcli.mask import MaskOptions, build
from maskcli.summary import spans, summarise
from strategies import cases, expected_cells


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_counts_equal_the_dense_definitions(case):
    tree, options, frame, valid = case
    built = build(ref.text(tree), MaskOptions(**options))
    cells = expected_cells(tree, options, frame, valid, built.batch)
    summary = summarise(built, (3, 4))
    assert summary.visible == int(cells.sum()) * built.heads and summary.total == cells.size * built.heads
    for row, plane in zip(summary.rows, cells):
        keys = plane.sum(axis=1)
        assert (row.visible, row.keys_min, row.keys_max, row.keys_median) == (int(plane.sum()) * built.heads, keys.min(), keys.max(), float(np.median(keys)))
        assert row.empty_rows == int((keys == 0).sum()) * built.heads
    rb, cb = summary.grid_blocks
    for grid, plane in zip(summary.grid, cells):
        expected = np.add.reduceat(np.add.reduceat(plane.astype(int), np.arange(0, plane.shape[0], rb), 0), np.arange(0, plane.shape[1], cb), 1)
        assert np.array_equal(grid, expected * built.heads)


def test_closed_forms_at_a_million_tokens():
    n, w = 1 << 20, 4096
    window = summarise(build(f"window({w})", length=n))
    assert window.visible == w * (w + 1) // 2 + (n - w) * w
    assert (window.rows[0].keys_min, window.rows[0].keys_median, window.rows[0].keys_max) == (1, w, w)
    sizes = ",".join(["4096"] * 256)
    docs = summarise(build(f"document(sizes=[{sizes}]) & window({w})"))
    assert docs.visible == 256 * 4096 * 4097 // 2
    causal = summarise(build("causal", length=n, lengths=f"{n},{n // 2}"))
    assert [r.visible for r in causal.rows] == [n * (n + 1) // 2, (n // 2) * (n // 2 + 1) // 2 + (n // 2) * (n // 2)]
    assert causal.json()["visible_cells"] == sum(r.visible for r in causal.rows)
    empty = summarise(build("causal & ~sink(10)", length=n))  # rows 0-9 see only the sink keys, which are hidden
    assert empty.rows[0].empty_rows == 10 and empty.rows[0].empty_spans == [(0, 9)]


def test_spans_are_runs_of_absolute_positions():
    assert spans(np.array([1, 1, 0, 1, 0, 0, 1], dtype=bool), 100) == [(100, 101), (103, 103), (106, 106)]
    assert spans(np.zeros(5, dtype=bool), 0) == []
    assert len(spans(np.tile([True, False], 50), 0)) == 8


def test_cell_by_cell_counting_reports_progress():
    seen = []
    labels = ",".join(str(v) for v in [0, 2, 1] * 300)
    summary = summarise(build(f"chunk({labels})"), progress=lambda done, total: seen.append((done, total)))
    assert "cell by cell" in summary.how and seen and seen[-1][0] == seen[-1][1] == 900


def test_heads_that_differ_are_counted_head_by_head_and_every_count_covers_every_head(tmp_path):
    from maskcli.mask import from_tensor

    keep = np.zeros((2, 3, 4, 5), dtype=bool)  # head h of batch row b sees the first b + h + 1 keys; head 2 of row 0 sees none
    for b in range(2):
        for h in range(3):
            keep[b, h, :, : b + h + 1] = True
    keep[0, 2] = False
    summary = summarise(from_tensor(keep, "heads"), (2, 5))
    assert summary.visible == int(keep.sum()) and summary.total == keep.size
    assert [r.visible for r in summary.rows] == [int(keep[b].sum()) for b in range(2)]
    assert sum(r.visible for r in summary.rows) == summary.json()["visible_cells"]
    keys = keep.sum(-1)  # (B, H, Lq)
    assert [(r.keys_min, r.keys_max, r.keys_median) for r in summary.rows] == [(keys[b].min(), keys[b].max(), float(np.median(keys[b]))) for b in range(2)]
    assert [r.empty_rows for r in summary.rows] == [4, 0] and summary.rows[0].empty_spans == [(0, 3)]
    for b in range(2):
        assert np.array_equal(summary.grid[b], keep[b].reshape(3, 2, 2, 5, 1).sum(axis=(0, 2, 4)))
    # a mask_mod that reads h: counted head by head, cell by cell
    (tmp_path / "mine.py").write_text("def mine(b, h, q, kv):\n    return kv <= h\n")
    from maskcli.sources import registry

    mod = summarise(registry.load(None, MaskOptions(mask_mod=str(tmp_path / "mine.py") + ":mine", heads=3, length=6)))
    assert mod.visible == 6 * (1 + 2 + 3) and mod.rows[0].keys_min == 1 and mod.rows[0].keys_max == 3
