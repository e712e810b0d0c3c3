"""checks/rowless.py: one mask for every batch row over rows whose held lengths differ (padding-not-per-row)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug, first, traced

ROWLESS = Path(__file__).parent / "data" / "rowless"


def test_doctr_parseq_padding_mask_always_true(tmp_path):
    """docTR#1227: PARSeq's `(gt != PAD) | (gt != EOS)` is True everywhere; the reverse permutation's queries see the
    short word's EOS and padding. seq_len counts the characters, the keys are SOS + characters."""
    hit = check_bug(tmp_path, "doctr_parseq_training_padding_mask_always_true", "padding-not-per-row")[0]
    assert "seq_len" in hit["source"]
    b, q, k = hit["cell"]
    assert b == 0 and q < 3 <= k  # a query of the 2-character word (SOS + 2 real) sees a key past its 3 tokens


def test_cls_local_window_lengths_unused(tmp_path):
    """Written another way: a CLS token in front of right-padded frames, a symmetric local window (|q - k| <= 1)
    shared by every row as SDPA's float mask, frame_lens counting the frames alone; the fix is quiet."""
    status, found, report = traced(tmp_path, "cls_local_window_lengths_unused", False, ROWLESS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "padding-not-per-row")
    assert hit["severity"] == "wrong" and "frame_lens" in hit["source"]
    real = np.arange(6)[None, :] < np.array([3, 5])[:, None] + 1  # CLS + frames
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: abs(q - k) <= 1 and real[b, q] and not real[b, k])
    status, found, report = traced(tmp_path, "cls_local_window_lengths_unused", True, ROWLESS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_causal_over_right_padding_is_quiet():
    """A causal mask shared by right-padded rows keeps to their padding (no real query sees a later key): quiet, as
    is a mask that differs between rows; one that lets a short row's real query see past it is found, by a double
    loop's first cell."""
    from maskcli.checks.rowless import one_mask_for_all

    class Call:
        def __init__(self, cells, lengths):
            self.shape = (2, 1, 4, 4)
            self.mask, self.index, self.where, self.api, self.step = "m", 0, "attn", "softmax", 0
            self.stored = {"form": "dense", "planes": (cells.shape[0], 1), "shape": self.shape}
            self.cells = cells
            self.details = {"held_padding": [{"kind": "lengths", "rows": np.array(lengths), "name": "lens",
                                              "where": "f()"}]}

    import maskcli.checks.rowless as rowless
    from maskcli.checks.context import Run

    def run_of(cells, lengths):
        call = Call(cells, lengths)
        original = rowless.keep
        rowless.keep = lambda c: c.cells
        try:
            return one_mask_for_all(Run([call]))
        finally:
            rowless.keep = original

    causal = np.tril(np.ones((4, 4), dtype=bool))[None, None]
    assert run_of(causal, [2, 4]) == []
    per_row = np.stack([causal[0], causal[0] & (np.arange(4) < 2)[None, None, :]])
    assert run_of(per_row, [2, 4]) == []
    band = (np.abs(np.arange(4)[:, None] - np.arange(4)[None, :]) <= 1)[None, None]
    found = run_of(band, [2, 4])
    assert len(found) == 1
    real = np.arange(4)[None, :] < np.array([2, 4])[:, None]
    assert found[0][1].cell == first((2, 4, 4), lambda b, q, k: abs(q - k) <= 1 and real[b, q] and not real[b, k])
