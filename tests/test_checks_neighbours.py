"""checks/neighbours.py (and trace/stated.py's neighbour count): a k-nearest-neighbour attention's real nodes against
the k its module states and the padding the program holds."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, traced

NEIGHBOURS = Path(__file__).parent / "data" / "neighbours"


def test_en_transformer_knn_neighbours_include_padding(tmp_path):
    """En-transformer b98429c: padded atoms at the origin ranked among the 3 nearest, masked after the topk."""
    hits = check_bug(tmp_path, "en_transformer_knn_neighbours_include_padding", "neighbours-padded")
    assert tuple(hits[0]["cell"])[:2] == (1, 0)  # molecule 1's first atom, of 4 real: sees 1 of 3 slots


def test_point_cloud_knn_left_padded(tmp_path):
    """Written another way: `num_neighbors = 2`, left-padded, `node_pad_mask` True = padding, cdist ranking, einsum
    scores; the first node flagged is the first real node (by the padding, a plain loop) whose own 2 nearest points by
    the same distances include a padded one. Its fix (padding ranked last) is quiet."""
    status, found, report = traced(tmp_path, "point_cloud_knn_left_padded", False, NEIGHBOURS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "neighbours-padded")
    assert hit["severity"] == "wrong"
    torch.manual_seed(0)
    n, lengths = 5, [5, 3]
    points = torch.randn(2, n, 3) * 4
    points[1, :2] = points[1, 2:4] + 0.01
    expected = None
    for b in range(2):
        pad = [i < n - lengths[b] for i in range(n)]
        for i in range(n):
            nearest = sorted(range(n), key=lambda j: float((points[b, i] - points[b, j]).norm()))[:2]
            if expected is None and not pad[i] and any(pad[j] for j in nearest):
                expected = (b, i)
    assert tuple(hit["cell"])[:2] == expected
    status, found, report = traced(tmp_path, "point_cloud_knn_left_padded", True, NEIGHBOURS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_equiformer_neighbor_topk_selects_padding_tokens(tmp_path):
    """equiformer-pytorch 5dfc465: padding atoms (at the origin) ranked by the topk beside a finite `valid_radius`, then
    hidden by the neighbour mask; the radius hides only the farthest slots, so a hidden slot before a seen one is not
    its doing."""
    hits = check_bug(tmp_path, "equiformer_neighbor_topk_selects_padding_tokens", "neighbours-padded")
    assert tuple(hits[0]["cell"])[:2] == (1, 0)  # molecule 1's first atom, of 5 real


def test_schnet_cutoff_knn_right_padded(tmp_path):
    """Written another way: `n_neighbors = 3` beside a `cutoff`, right-padded `atom_lens`, a sort for the ranking,
    matmul scores over gathered keys, torch.where. The first node flagged is the first real node (a plain loop over
    the same distances) whose 3 nearest atoms hold a hidden one (padded, or beyond the cutoff) before a seen one; a
    node whose neighbours all lie beyond the cutoff is not (the fix keeps it: quiet)."""
    status, found, report = traced(tmp_path, "schnet_cutoff_knn_right_padded", False, NEIGHBOURS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "neighbours-padded")
    assert hit["severity"] == "wrong"
    torch.manual_seed(1)
    lengths, n, cutoff = [5, 7], 7, 2.5
    pos = torch.randn(2, n, 3)
    pos[0, 4] = pos[0, 4] + 6.0
    pos[0, 5:] = pos[0, 1:3] + 0.05
    expected = None
    for b in range(2):
        for i in range(lengths[b]):
            others = sorted((j for j in range(n) if j != i), key=lambda j: float((pos[b, i] - pos[b, j]).norm()))[:3]
            seen = [j < lengths[b] and float((pos[b, i] - pos[b, j]).norm()) <= cutoff for j in others]
            if expected is None and any(not s and any(seen[r + 1:]) for r, s in enumerate(seen)):
                expected = (b, i)
    assert tuple(hit["cell"])[:2] == expected
    status, found, report = traced(tmp_path, "schnet_cutoff_knn_right_padded", True, NEIGHBOURS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
