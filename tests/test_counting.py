"""Exact counts per block, from intervals and cell by cell, against sums of the dense cells."""

from __future__ import annotations

import numpy as np
import pytest

from maskcli.counting import block_counts, block_shares, edges, how_counted
from maskcli.mask import build, from_tensor


def dense_counts(cells, q_edges, k_edges, k_start=0):
    return np.array([
        [cells[q_edges[i] : q_edges[i + 1], k_edges[j] - k_start : k_edges[j + 1] - k_start].sum() for j in range(len(k_edges) - 1)]
        for i in range(len(q_edges) - 1)
    ])


@pytest.mark.parametrize(
    ("text", "options"),
    [
        ("causal", {"length": 37}),
        ("window(5) | sink(3)", {"length": 41, "offset": 7}),
        ("document(sizes=[9,20,11]) & ~window(3)", {}),
        ("chunk(" + ",".join(str(v) for v in [0, 1, 0, 2, 1, 3] * 6) + ")", {}),  # labels go down: cell by cell
        ("causal", {"length": 13, "kv_start": 4}),
    ],
)
@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (4, 3), (7, 16), (64, 64)])
def test_block_counts_are_exact(text, options, rows, cols):
    built = build(text, **options)
    f = built.frame
    q_edges, k_edges = edges(f.q_len, rows), edges(f.k_len, cols, f.k_start)
    counts = block_counts(built, 0, 0, rows, cols)
    assert np.array_equal(counts, dense_counts(built.dense()[0, 0], q_edges, k_edges, f.k_start))
    shares = block_shares(built, 0, 0, rows, cols)
    assert ((shares > 0) == (counts > 0)).all() and shares.max() <= 1


def test_edges_cover_the_axis_with_a_short_last_block():
    assert edges(10, 4).tolist() == [0, 4, 8, 10]
    assert edges(8, 4, start=3).tolist() == [3, 7, 11]
    assert edges(3, 5).tolist() == [0, 3]


def test_how_counted_says_which_path():
    assert how_counted(build("causal")) == "exact, from key intervals"
    assert "cell by cell" in how_counted(build("chunk(1,0)"))
    tensor = from_tensor(np.tril(np.ones((1, 1, 4, 4), dtype=bool)), "file.pt")
    assert "cell by cell" in how_counted(tensor)
    assert np.array_equal(block_counts(tensor, 0, 0, 2, 2), [[3, 0], [4, 3]])


def test_a_million_token_window_band_is_never_drawn_empty():
    built = build("window(128)", length=1 << 20)
    shares = block_shares(built, 0, 0, 1 << 15, 1 << 14)  # a 32 x 64 map
    diagonal = [shares[i, 2 * i] for i in range(32)]
    assert all(share > 0 for share in diagonal)
    assert shares[5, 20] == 0


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("document", {}),
        ("document", {"offset": 50, "length": 250}),
        ("document", {"lengths": "300,120"}),
        ("segment", {"kv_start": 30, "kv_len": 270, "length": 60, "align": "bottom-right"}),
        ("blocks", {"ids": ";".join([",".join(["5"] * 250 + ["0"] * 50), ",".join(["0"] * 20 + ["5"] * 280)]), "pad_id": 0}),
    ],
)
def test_labels_that_come_back_often_are_counted_per_label_exactly(name, options, monkeypatch):
    import definitions as ref

    from maskcli import counting
    from maskcli.summary import summarise

    rng = np.random.default_rng(len(name) + len(options))
    labels = rng.integers(-1 if name == "blocks" else 0, 2, size=(2, 300)).tolist()  # about 75 runs per label: not few
    labels[1] = [i % 7 for i in range(300)]  # 7 cycling ids
    text = f"{name}({';'.join(','.join(map(str, row)) for row in labels)})"
    built = build(text, **options)
    f = built.frame
    valid = None if f.key_valid is None else f.key_valid.tolist()
    left = [0] * built.batch
    cells = np.array(ref.dense(("kind", name, {"labels": labels}), q0=f.q_start, lq=f.q_len, k0=f.k_start, lk=f.k_len,
                               batch=built.batch, valid=valid, ids_valid_left_pad=left))
    assert not built.exact and built.counted is not None
    assert how_counted(built).startswith("exact, from running counts per label (")
    summary = summarise(built, grid=(7, 9))
    assert [row.visible for row in summary.rows] == cells.sum((1, 2)).tolist()
    assert [row.keys_max for row in summary.rows] == cells.sum(2).max(1).tolist()
    assert [row.empty_rows for row in summary.rows] == (cells.sum(2) == 0).sum(1).tolist()
    q_edges, k_edges = edges(f.q_len, -(-f.q_len // 7)), edges(f.k_len, -(-f.k_len // 9), f.k_start)
    for b in range(built.batch):
        assert np.array_equal(summary.grid[b], dense_counts(cells[b], q_edges, k_edges, f.k_start))
        assert np.array_equal(block_counts(built, b, 0, 16, 16), dense_counts(cells[b], edges(f.q_len, 16), edges(f.k_len, 16, f.k_start), f.k_start))
    monkeypatch.setattr(counting, "COUNTED_LIMIT", 0)  # too many edges for the per-label counts: cell by cell, the same
    assert np.array_equal(block_counts(built, 1, 0, 16, 16), dense_counts(cells[1], edges(f.q_len, 16), edges(f.k_len, 16, f.k_start), f.k_start))


def test_counting_cell_by_cell_past_the_limit_is_refused_up_front_by_every_path(tmp_path, monkeypatch):
    from bounded import MIB, builds_under
    from typer.testing import CliRunner

    from maskcli.commands import app

    np.save(tmp_path / "alternating.npy", np.arange(1_000_000) % 2)  # 500,000 runs per label: not few intervals
    monkeypatch.chdir(tmp_path)
    # its summary and its map are counted per label, exactly: each row sees the 500,000 keys of its label
    summary = CliRunner().invoke(app, ["show", 'segment("alternating.npy")', "--summary"])
    assert summary.exit_code == 0 and "visible cells: 500,000,000,000 of 1,000,000,000,000 (50.00%)" in summary.stdout
    assert CliRunner().invoke(app, ["show", 'segment("alternating.npy")']).exit_code == 0
    for args in (["blocks", 'segment("alternating.npy")'], ["diff", 'segment("alternating.npy")', "causal"],
                 ["diff", 'segment("alternating.npy")', "causal", "--png", "d.png"]):
        with builds_under(512 * MIB):  # nothing of 10^12 cells was counted
            result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "label 0 comes back in 500000 separate runs" in result.stderr and "1,000,000,000,000 cells" in result.stderr
        assert result.stderr.count("\n") == 1
    assert [p.name for p in tmp_path.iterdir()] == ["alternating.npy"]


def test_a_slow_predicate_is_refused_once_its_pace_is_known(tmp_path, monkeypatch):
    from maskcli import counting
    from maskcli.errors import MaskError

    monkeypatch.setattr(counting, "TILE_CELLS", 64)  # many small bands
    monkeypatch.setattr(counting, "PATIENCE_S", 0.0)
    monkeypatch.setattr(counting, "PACE_AFTER_S", 0.0)
    mask = build("chunk(" + ",".join(str(v) for v in [1, 0] * 200) + ")")  # labels go down: cell by cell
    with pytest.raises(MaskError, match="counting it cell by cell would take about"):
        block_counts(mask, 0, 0, 8, 8)
    monkeypatch.setattr(counting, "PATIENCE_S", 1e9)
    assert block_counts(mask, 0, 0, 8, 8).sum() == mask.dense().sum()
