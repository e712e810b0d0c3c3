"""checks/multiplied.py (and trace/multiplied.py): scores multiplied by a 0/1 mask before their softmax, on the
published bugs' reproductions (tests/data/bugs) and each written another way (tests/data/multiplied: a padded encoder,
a variate graph's top-k mask), all quiet fixed; the cells read against a loop over the scores."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from checkbugs import check_bug
from maskcli.trace.multiplied import Products

MULTIPLIED = Path(__file__).parent / "data" / "multiplied"


def test_swin_transformer_pytorch_window_mask_multiplied_into_the_logits(tmp_path):
    """berniwal/swin-transformer-pytorch ae5ae7b (written blind, batch blind-ek): the 1/0 upper_lower / left_right
    masks multiplied into the shifted windows' logits (`dots *= mask`); the fix adds a 0/-inf mask."""
    hits = check_bug(tmp_path, "swin_transformer_pytorch_window_attention_multiplicative_shift_mask", "ones-multiplied")
    assert all("to logit 0, not -inf" in hit["message"] for hit in hits)


def test_a_padded_encoder_multiplying_its_key_mask_into_the_scores(tmp_path):
    """Written another way: torch.mul(scores, keep[:, None, None, :]) over a right-padded batch of 3 (6, 3 and 2 real
    tokens), 4 heads, two layers (one site); every query row of a padded sample weighs its padded keys at logit 0."""
    ids_real = (6, 3, 2)
    cells = rows = 0
    for real in ids_real:  # (the loop: each head and query row of a sample with padding, each padded key)
        for _head in range(4):
            for _query in range(6):
                padded = [k for k in range(6) if k >= real]
                if padded and real:
                    cells, rows = cells + len(padded), rows + 1
    hits = check_bug(tmp_path, "padded_encoder_key_mask_multiplied_into_scores", "ones-multiplied", MULTIPLIED)
    assert hits and all(f"set {cells} cells of {rows} query rows" in hit["message"] for hit in hits), hits


def test_timefilter_graph_filter_knn_and_moe_masks_multiplied_before_the_softmax(tmp_path):
    """TROUBADOUR000/TimeFilter#13 (same layers in thuml/Time-Series-Library; written blind, batch blind-et):
    GraphLearner multiplies the edge scores by its KNN mask (`mask_topk`: the alpha * L smallest scattered to 0) and
    its MoE region mask, and GraphFilter softmaxes them: every filtered-out edge still weighs exp(0). The fix fills
    them with -inf: the KNN's topk(largest=False) states the keys it drops (no padding: padding-seen-by-one quiet),
    and the MoE mask drops more after it (no slot of a top-k lost: topk-mask-not-topk quiet)."""
    hits = check_bug(tmp_path, "timefilter_graphfilter_zero_masked_edges_before_softmax", "ones-multiplied")
    assert hits and all("to logit 0, not -inf" in hit["message"] for hit in hits)


def test_a_variate_graph_top_k_mask_multiplied_into_padded_scores(tmp_path):
    """Written another way: an iTransformer-style encoder's sparse graph over variate tokens, `zeros_like(scores)`
    scattered to 1 at each row's topk(3) and multiplied into einsum scores, a batch of 6 and 4 variables (padded to 6,
    the padding filled with -inf after the product), 2 heads. Every query row (padded variates' too: they attend the
    real ones) keeps 3 real keys and weighs the rest of its real keys at logit 0."""
    real, heads, length, k = (6, 4), 2, 6, 3
    cells = rows = 0
    for n in real:  # (the loop: each head and query row of each sample, its real keys outside the top-k)
        for _head in range(heads):
            for _query in range(length):
                zeroed = [key for key in range(n)][k:]
                if zeroed:
                    cells, rows = cells + len(zeroed), rows + 1
    hits = check_bug(tmp_path, "variate_topk_graph_mask_multiplied_into_scores", "ones-multiplied", MULTIPLIED)
    assert hits and all(f"set {cells} cells of {rows} query rows" in hit["message"] for hit in hits), hits


def test_a_mask_scattered_into_zeros_like_the_scores_is_read_as_a_mask():
    """Both operands followed as scores (the mask made by `zeros_like(scores).scatter`): the 0/1 one is the mask,
    whichever side of the product it is on."""
    torch.manual_seed(0)
    scores = torch.randn(1, 2, 4, 4)
    keep = torch.zeros_like(scores).scatter(-1, scores.topk(2, dim=-1).indices, 1.0)
    zeroed = [(h, q, j) for h in range(2) for q in range(4) for j in range(4) if keep[0, h, q, j] == 0]
    for pair in ((keep, scores), (scores, keep)):
        products = Products()
        out = pair[0] * pair[1]
        products.after(torch.Tensor.__mul__, pair, out, lambda t: t is scores or t is keep)
        assert _read(products, out) == {"cells": len(zeroed), "rows": 8}


def _read(products: Products, x: torch.Tensor) -> dict | None:
    call, seen = SimpleNamespace(details={}), SimpleNamespace(details={})
    products.of(x, call, seen)
    return call.details.get("multiplied")


def test_the_cells_read_are_the_loops_and_a_fill_after_masks_them():
    torch.manual_seed(0)
    scores, keep = torch.randn(1, 2, 4, 4), torch.ones(4, 4).tril()
    products = Products()
    out = scores * keep
    products.after(torch.Tensor.__mul__, (scores, keep), out, lambda t: t is scores)
    zeroed = [(h, q, k) for h in range(2) for q in range(4) for k in range(4) if keep[q, k] == 0]
    rows = {(h, q) for h, q, _ in zeroed}
    assert _read(products, out) == {"cells": len(zeroed), "rows": len(rows)}
    filled = out.masked_fill(keep == 0, float("-inf"))  # (the fix's fill after the product: carried, then masked)
    products.after(torch.Tensor.masked_fill, (out, keep == 0, float("-inf")), filled, lambda t: t in (scores, out))
    assert _read(products, filled) is None
    assert _read(Products(), out) is None  # (no product seen)


def test_a_view_of_the_scores_multiplied_in_place_marks_its_windows_only():
    """berniwal's `dots[:, :, -2:] *= mask` on (B, H, windows, N, N): only the last two windows are marked."""
    torch.manual_seed(0)
    dots, mask = torch.randn(1, 1, 3, 4, 4), torch.tensor([[1.0, 0.0], [0.0, 1.0]]).repeat(2, 2)
    view = dots[:, :, -2:]
    products = Products()
    view *= mask
    products.after(torch.Tensor.__imul__, (view, mask), view, lambda t: t is view)
    expected = sum(1 for w in range(3) for q in range(4) for k in range(4) if w >= 1 and mask[q, k] == 0)
    assert _read(products, dots) == {"cells": expected, "rows": 2 * 4}


def test_graphormer_pyg_per_graph_batch_mask_multiplied_into_the_scores(tmp_path):
    """leffff/graphormer-pyg#14 (commit f56d6487; written blind, batch blind-p): the 0/1 per-graph `batch_mask` built
    from PyG's `ptr` multiplies the scores, so a node weighs the other graph's nodes at logit 0; the fix multiplies
    by -1e6 across graphs (a product by other values) and zeroes those weights after the softmax. Two path graphs of
    3 and 4 nodes, one head: each node's row holds the other graph's nodes."""
    sizes = (3, 4)
    cells = sum(size * (sum(sizes) - size) for size in sizes)  # (each node, each node of the other graph)
    hits = check_bug(tmp_path, "graphormer_pyg_attention_head_batch_mask_multiplies_scores", "ones-multiplied")
    assert hits and all(f"set {cells} cells of {sum(sizes)} query rows" in hit["message"] for hit in hits), hits
