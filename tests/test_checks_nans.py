"""checks/nans.py: NaN rows of an earlier softmax (every key -inf) that reach a later call's real queries."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, traced

NANS = Path(__file__).parent / "data" / "nans"


def test_graphormer_bias_padded_with_minus_inf(tmp_path):
    """dgl#5476: the spatial bias padded with -inf empties the padded nodes' rows; the next layer's real nodes of
    that graph (3 real nodes of 5, batch rows 4-7 after the heads are folded into the batch) score NaN."""
    [hit] = check_bug(tmp_path, "dgl_graphormer_spatial_encoding_pads_minus_inf", "nan-spread")
    assert "query rows 0-2 of batch row 4 are NaN" in hit["message"] and "rows 3-4 saw no key" in hit["message"]
    assert hit["cell"] == [4, 0, 0]


def test_pair_mask_masked_fill_spreads_through_values(tmp_path):
    """Written another way: a masked_fill of the outer product of the real flags (padded rows emptied), right- and
    left-padded rows, three layers: the NaN reaches the real queries' scores by the values of the second layer.
    The rows flagged are batch row 0's real items, by a plain loop over its flags; the fix (keys only) is quiet."""
    real = [[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]]
    rows = [q for q in range(6) if real[0][q]]
    status, found, report = traced(tmp_path, "set_encoder_pair_mask_empties_padded_rows", False, NANS)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "nan-spread"]
    assert hit["severity"] == "wrong" and f"query rows {rows[0]}-{rows[-1]} of batch row 0" in hit["message"]
    status, found, report = traced(tmp_path, "set_encoder_pair_mask_empties_padded_rows", True, NANS)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report


def test_quiet_where_the_emptied_rows_are_zeroed_or_never_read(tmp_path):
    """One layer whose padded rows are NaN and nothing after it: rows.py's suspicious fully-masked, no nan-spread."""
    program = tmp_path / "one_layer.py"
    program.write_text(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "s = torch.randn(2, 1, 4, 4)\n"
        "real = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).bool()\n"
        "keep = real[:, None, :, None] & real[:, None, None, :]\n"
        "w = s.masked_fill(~keep, float('-inf')).softmax(-1)\n"
        "print(torch.isnan(w).any().item())\n")
    status, found, report = traced(tmp_path, "one_layer", False, tmp_path)
    assert "nan-spread" not in {f["code"] for f in found}, report
    assert status == 0, report


def test_exllamav2_padded_batch_attn_mask_neg_inf_nan(tmp_path):
    """exllamav2 586f25c: the causal triangle filled with -inf empties left-padded rows; the NaN reaches the real
    tokens through the next layer and the cache (written blind, batch blind-r; caught before any rule was changed
    for it)."""
    check_bug(tmp_path, "exllamav2_padded_batch_attn_mask_neg_inf_nan", "nan-spread")
