"""checks/fewseen.py: a real query that sees keys the same square mask calls padding (padding-seen-by-one), caught in
the published bug's reproduction (tests/data/bugs) and in a program written another way (tests/data/fewseen), quiet on
the fixes; the flagged cells against a double loop over positions."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug, first
from maskcli.checks.fewseen import against

FEWSEEN = Path(__file__).parent / "data" / "fewseen"


def test_a_cls_row_left_all_ones_over_a_padded_set_is_found(tmp_path):
    # theislab/CellFlow#226: the set mask copied into [1:, 1:] only; the CLS row (query 0) sees the padded elements
    found = check_bug(tmp_path, "cellflow_token_pooling_cls_attends_padded_set", "padding-seen-by-one")
    assert tuple(found[0]["cell"]) == first((2, 5, 5), lambda b, q, k: q == 0 and k >= 3)


def test_an_appended_summary_token_that_sees_the_padding_is_found(tmp_path):
    found = check_bug(tmp_path, "summary_token_appended_row_unmasked", "padding-seen-by-one", folder=FEWSEEN)
    lengths = (5, 3, 2)  # the summary token is key / query 5
    assert tuple(found[0]["cell"]) == first((3, 6, 6), lambda b, q, k: q == 5 and lengths[b] <= k < 5)


def _loop(cells: np.ndarray) -> np.ndarray:
    """The reference: per row, tokens that see themselves; real ones are seen by at least half the others; padding
    keys are hidden from themselves and from two real queries; flag a real query seeing a padding key."""
    rows, length, _ = cells.shape
    out = np.zeros_like(cells)
    for b in range(rows):
        own = [bool(cells[b, t, t]) for t in range(length)]
        count = sum(own) - 1
        real = []
        for t in range(length):
            others = sum(1 for q in range(length) if q != t and own[q] and cells[b, q, t])
            real.append(own[t] and count >= 2 and 2 * others >= count)
        if any(cells[b, q, k] and not own[q] and not own[k] for q in range(length) for k in range(length)):
            continue  # (tokens hidden from themselves that see one another: no padding)
        for k in range(length):
            hidden = sum(1 for q in range(length) if real[q] and not cells[b, q, k])
            if own[k] or hidden < 2:
                continue
            for q in range(length):
                out[b, q, k] = real[q] and cells[b, q, k]
    return out


def test_the_cells_against_a_loop_and_quiet_on_padding_masks_and_causal_ones():
    valid = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], bool)
    pair = valid[:, :, None] & valid[:, None, :]
    with_cls = np.ones((3, 6, 6), bool)
    with_cls[:, 1:, 1:] = pair
    assert _loop(with_cls).any() and (against(with_cls) == _loop(with_cls)).all()
    assert not against(pair).any()  # an encoder's pair mask: no real query sees padding
    keys = np.broadcast_to(valid[:, None, :], (3, 5, 5))  # HF's key mask over every row (padding rows see real keys)
    assert not against(keys).any()
    causal = np.tril(np.ones((5, 5), bool))[None] & keys
    assert not against(causal).any()
    left = valid[:, ::-1]  # left padding, its fully masked rows unmasked whole (transformers' SDPA)
    unmasked = np.tril(np.ones((5, 5), bool))[None] & left[:, None, :]
    unmasked[~left] = True
    assert not against(unmasked).any() and (against(unmasked) == _loop(unmasked)).all()


def test_random_masks_against_the_loop():
    """The flagged cells on random masks (diagonals kept or not, columns set whole) are the loop's, cell for cell."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        rows, length = int(rng.integers(1, 4)), int(rng.integers(1, 9))
        cells = rng.random((rows, length, length)) < rng.random()
        if rng.random() < 0.5:
            cells |= np.eye(length, dtype=bool)[None]
            cells[:, :, int(rng.integers(0, length))] = rng.random() < 0.5
        assert (against(cells) == _loop(cells)).all()


def test_a_graph_guided_mask_whose_nodes_see_one_another_is_no_padding():
    """GraphCodeBERT's data-flow mask (quiet_blind round 60), built as its run.py builds it: code tokens see each other,
    the special tokens see every real token, each data-flow node sees its code span and the nodes it is linked to (not
    itself), each code span sees its node; pads see nothing. The nodes, hidden from themselves, see one another: no
    padding, and the special token that sees them all is no row left unmasked. A CLS row left all ones over a padded set
    whose pads see nothing is still said."""
    code, nodes, total = 6, 3, 11  # 6 code tokens (0 and 5 special), 3 nodes, 2 pads
    cells = np.zeros((1, total, total), bool)
    cells[0, :code, :code] = True
    cells[0, [0, 5], :code + nodes] = True
    for node, (a, b) in enumerate([(1, 2), (2, 4), (4, 5)]):
        cells[0, code + node, a:b] = True
        cells[0, a:b, code + node] = True
    for node, linked in enumerate([[1], [0, 2], [1]]):
        for other in linked:
            cells[0, code + node, code + other] = True
    assert not against(cells).any() and not _loop(cells).any()
    valid = np.array([[1, 1, 1, 0, 0]], bool)
    with_cls = np.ones((1, 6, 6), bool)
    with_cls[:, 1:, 1:] = valid[:, :, None] & valid[:, None, :]
    assert against(with_cls).any()
