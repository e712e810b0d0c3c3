"""checks/nans.py: NaN rows of an earlier softmax (every key -inf) that reach a later call's real queries."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

NANS = Path(__file__).parent / "data" / "nans"
FIXQ2 = Path(__file__).parent / "data" / "fixq2"


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


def test_vit_padding_patches_filled_with_minus_inf(tmp_path):
    """lucidrains/vit-pytorch#26 (written blind; fixed by 6c8dfc1's finite fill): the padding patches' rows are NaN
    at the first layer, and at the second the real tokens' weights are finite (their NaN scores against the padded
    keys filled with -inf again) while their output is NaN, read through the values. The real rows are CLS and the
    patches of the mask's top half, by a loop over the patch mask (CLS prepended)."""
    [hit] = check_bug(tmp_path, "vit_pytorch_padding_patch_mask_neg_inf_nan", "nan-spread")
    patches = [r < 2 for r in range(4) for _ in range(4)]  # mask[0, 2:, :] = False
    real = [0] + [1 + i for i, kept in enumerate(patches) if kept]
    assert f"query rows {real[0]}-{real[-1]} of batch row 0" in hit["message"], hit
    assert "the output" in hit["message"]


def test_nan_values_of_a_left_padded_encoder_reach_its_real_queries(tmp_path):
    """Written another way: a left-padded two-layer encoder with torch.matmul, whose emptied rows it meant to zero
    into a copy it never reads (tests/data/fixq2): the second layer's real queries (positions 2-5 of row 0, by a loop
    over the padding) are NaN through the values; the fix is quiet."""
    real = [1 if t >= 2 else 0 for t in range(6)]
    rows = [t for t in range(6) if real[t]]
    status, found, report = traced(tmp_path, "streaming_encoder_zeroed_rows_bound_to_another_name", False, FIXQ2)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "nan-spread"]
    assert hit["severity"] == "wrong" and f"query rows {rows[0]}-{rows[-1]} of batch row 0" in hit["message"], hit
    status, found, report = traced(tmp_path, "streaming_encoder_zeroed_rows_bound_to_another_name", True, FIXQ2)
    assert status == 0 and "nan-spread" not in {f["code"] for f in found}, report


def test_exllamav2_padded_batch_attn_mask_neg_inf_nan(tmp_path):
    """exllamav2 586f25c: the causal triangle filled with -inf empties left-padded rows; the NaN reaches the real
    tokens through the next layer and the cache (written blind, batch blind-r; caught before any rule was changed
    for it)."""
    check_bug(tmp_path, "exllamav2_padded_batch_attn_mask_neg_inf_nan", "nan-spread")


def test_icefall_zipformer_chunk_mask_padding_rows_nan(tmp_path):
    """k2-fsa/icefall#774: Zipformer's chunk mask with limited left chunks leaves padded frames' rows masked
    everywhere, NaN that reaches real frames in the next layer (batch blind-ai); written blind and caught before
    any rule was changed for it. The fix is quiet."""
    check_bug(tmp_path, "icefall_zipformer_chunk_mask_padding_rows_nan", "nan-spread")


def test_nan_rows_the_backward_pass_goes_through(tmp_path):
    """dgl#2657 (written blind, batch blind-be): the SetTransformer's padded node rows are -inf everywhere; their
    outputs are dropped, but backward through the weights @ values product gives NaN gradients. The fix zeroes those
    weights after the softmax. The rows that see no key in batch row 1, by a loop over the graphs' sizes."""
    found = check_bug(tmp_path, "dgl_set_transformer_padded_node_rows_fully_masked_nan_grads", "nan-rows-backward")
    sizes, heads = [5, 3, 4], 2
    empty = sum(heads * (max(sizes) - n) for n in sizes)
    assert found[0]["message"].startswith(f"{empty} query rows")
    assert f"query rows {sizes[1]}-{max(sizes) - 1} of batch row 1 see no key" in found[0]["message"]


def test_nan_rows_of_a_pair_mask_in_a_trained_point_set_model(tmp_path):
    """Written another way: one attention layer over padded point sets, a matmul softmax masked by the outer product
    of the real flags, the real points pooled, loss.backward(); the fix masks the keys only (nan-spread cannot say
    it: there is no later layer)."""
    found = check_bug(tmp_path, "point_set_pair_mask_backward_nan_grads", "nan-rows-backward", NANS)
    sizes, heads = [6, 4, 5], 2
    assert found[0]["message"].startswith(f"{sum(heads * (6 - n) for n in sizes)} query rows")


def test_isab_induced_points_over_an_empty_set_filled_with_minus_inf(tmp_path):
    """lucidrains/isab-pytorch 9968cf7 (written blind, batch blind-el): the ISAB's induced points cross-attend a padded
    batch of sets filled with float('-inf'); a set that is all padding gives NaN rows for every induced point, and the
    training step's backward pass goes through them. The fix fills with -finfo.max. The rows, by the sets' sizes."""
    found = check_bug(tmp_path, "isab_pytorch_attention_empty_set_mask_fill_neg_inf_nan", "nan-rows-backward")
    lengths, heads, induced = [9, 5, 0], 4, 6
    empty = [b for b, n in enumerate(lengths) if n == 0]
    assert found[0]["message"].startswith(f"{len(empty) * heads * induced} query rows")
    assert f"query rows 0-{induced - 1} of batch row {empty[0]} see no key" in found[0]["message"]


def test_latents_over_a_sample_with_no_events_cross_attention(tmp_path):
    """Written another way: Perceiver latents over a padded batch of events, heads folded in by repeat_interleave,
    torch.bmm, an out-of-place -inf fill from the lengths; one sample has no events; the fix zeroes the rows that see
    no key after the softmax."""
    found = check_bug(tmp_path, "perceiver_latents_empty_sample_cross_attention_nan_grads", "nan-rows-backward", NANS)
    lengths, heads, latents = [5, 0, 3], 2, 4
    folded = [n for n in lengths for _ in range(heads)]  # (repeat_interleave: each sample's heads side by side)
    assert found[0]["message"].startswith(f"{folded.count(0) * latents} query rows")
    assert f"query rows 0-{latents - 1} of batch row {folded.index(0)} see no key" in found[0]["message"]


def test_nan_rows_with_no_backward_pass_are_not_said(tmp_path):
    """The same NaN rows in a forward pass that autograd records but no backward pass follows: nothing is said."""
    program = tmp_path / "forward_only.py"
    source = (NANS / "point_set_pair_mask_backward_nan_grads.py").read_text()
    program.write_text(source.split("loss = nn.functional")[0] + "print(model(points, real).requires_grad)\n")
    status, found, report = traced(tmp_path, "forward_only", False, tmp_path)
    assert not [f for f in found if f["code"] == "nan-rows-backward"], report


def test_fastplms_fastesm_query_and_key_mask_rows_nan(tmp_path):
    """Synthyra/FastPLMs 0a5ffc4 (written blind, batch blind-df; caught before any rule was changed for it):
    FastESM2's get_attention_mask ANDs the query and the key axes, so on the manual (output_attentions) path the
    padded residues' rows are all -inf and NaN, which the second layer reads through V. The rows flagged are batch
    row 1's residues and those it empties, by a loop over the lengths; the fix (keys only) is quiet."""
    [hit] = check_bug(tmp_path, "fastplms_fastesm_get_attention_mask_query_rows_nan", "nan-spread")
    lengths, longest = [12, 7, 9], 12
    real = [q for q in range(longest) if q < lengths[1]]
    assert f"query rows {real[0]}-{real[-1]} of batch row 1 are NaN" in hit["message"], hit
    assert f"rows {lengths[1]}-{longest - 1} saw no key" in hit["message"], hit


def test_a_left_padded_pair_bias_built_with_where_empties_the_padded_rows(tmp_path):
    """The FastPLMs bug written another way: a passage encoder over left-padded passages adds
    torch.where(real_q & real_k, 0, -inf) to einsum scores, three layers; the padded positions' rows are NaN at the
    first and the second layer's real queries read them. The rows flagged are batch row 1's real tokens and those
    its padding empties, by a loop over the left padding; the fix (the key axis only) is quiet."""
    found = check_bug(tmp_path, "left_padded_encoder_pair_bias_where_minus_inf", "nan-spread", NANS)
    lengths, longest = [8, 5, 3], 8
    real = [q for q in range(longest) if q >= longest - lengths[1]]
    padded = [q for q in range(longest) if q not in real]
    assert f"query rows {real[0]}-{real[-1]} of batch row 1 are NaN" in found[0]["message"], found
    assert f"rows {padded[0]}-{padded[-1]} saw no key" in found[0]["message"], found
    assert found[0]["cell"] == [1, real[0], 0], found


def test_dia_encoder_pad_query_rows_masked_everywhere(tmp_path):
    """nari-labs/dia#252 (998fc25; written blind, batch blind-dl, caught before any rule was changed for it):
    create_attn_mask became p_mask_q & p_mask_k, so the padded text's query rows see no key; the MPS path's -inf
    softmax makes them NaN, which the next layer's real queries read through V. Row 0's real tokens, by a loop over
    the texts' lengths (the CFG pairs: 6, 6, 12, 12 of 16)."""
    [hit] = check_bug(tmp_path, "dia_encoder_pad_query_rows_fully_masked_nan", "nan-spread")
    lengths = (6, 6, 12, 12)
    real = [q for q in range(16) if q < lengths[0]]
    assert f"query rows {real[0]}-{real[-1]} of batch row 0" in hit["message"], hit


def test_pair_mask_product_of_real_flags_with_heads_folded_into_the_batch(tmp_path):
    """Written another way: heads folded into the batch (B * H, T, T), torch.bmm, the pair mask the product of the
    right-padded rows' real flags as floats, masked_fill_ in place with -inf; the fix lets pad queries attend pad keys
    as dia's does. The second layer's real queries of batch row 0 (its 6 phonemes, by a loop over the lengths)."""
    [hit] = check_bug(tmp_path, "phoneme_encoder_bmm_pair_mask_pad_rows_nan", "nan-spread", NANS)
    lengths = (6, 10, 3)
    real = [q for q in range(10) if q < lengths[0]]
    assert f"query rows {real[0]}-{real[-1]} of batch row 0" in hit["message"], hit


def test_onnxscript_sdpa_bool_mask_lowering_without_its_nan_guard(tmp_path):
    """microsoft/onnxscript#2479 (ecb7677; written blind, batch blind-fb, caught before any rule was changed for it):
    torch_lib's SDPA with a bool mask adds Where(mask, 0, -inf) before a plain Softmax, so a left-padded row's pad
    queries (causal & padding) are NaN, which the next layer's real queries of that row read as keys. The cell is a
    double loop's first real query over a padded key it reaches causally; the fix (Where(IsNaN(w), 0, w) after the
    Softmax, read by trace/after.py as those rows zeroed) is quiet."""
    [hit] = check_bug(tmp_path, "onnxscript_torchlib_sdpa_bool_mask_fully_masked_rows_nan", "nan-spread")
    real = [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: real[b][q] and not real[b][k] and k <= q), hit
    assert "query rows 2-5 of batch row 0 are NaN" in hit["message"], hit
    status, found, report = traced(tmp_path, "onnxscript_torchlib_sdpa_bool_mask_fully_masked_rows_nan", True)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_bf16_sdpa_decomposition_without_the_nan_guard_over_left_padding(tmp_path):
    """onnxscript#2479 written another way: a backend's decomposition table entry for SDPA, where(mask, 0, -inf)
    added to einsum logits and a plain softmax, run eagerly in bfloat16 on a (B, T, H, D) model, config a dict, three
    left-padded rows. Row 0's pad queries are NaN at the first layer and its real queries score NaN against them at
    the second. The cell is a double loop's first real query over a padded key it reaches causally; the fix
    (nan_to_num of the weights, read by trace/after.py as those rows zeroed) is quiet, with nothing suspicious."""
    name = "bf16_sdpa_decomposition_where_bool_mask_left_pad_rows_nan"
    found = check_bug(tmp_path, name, "nan-spread", NANS)
    ids = [[0, 0, 0, 11, 7, 30, 2], [0, 19, 4, 4, 22, 9, 17], [13, 5, 8, 41, 3, 6, 10]]
    real = [[i != 0 for i in row] for row in ids]
    assert tuple(found[0]["cell"]) == first((3, 7, 7), lambda b, q, k: real[b][q] and not real[b][k] and k <= q), found
    assert "query rows 3-6 of batch row 0 are NaN" in found[0]["message"], found
    status, found, report = traced(tmp_path, name, True, NANS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_decomposition_over_a_mask_with_its_unattended_rows_unmasked_is_quiet(tmp_path):
    """Correct: the same unguarded where(mask, 0, -inf) decomposition over left padding, its 4-D mask's rows with no
    key unmasked first (transformers' _unmask_unattended): no softmax over all -inf, nothing wrong or suspicious."""
    status, found, report = traced(tmp_path, "sdpa_decomposition_unmasks_unattended_left_pad_rows", False, NANS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_weights_zeroed_by_where_isnan_in_a_copy_the_product_does_not_read(tmp_path):
    """The NaN guard computed (where(isnan(w), 0, w)) but the product with the values reads the softmax's own weights:
    the rows are not zeroed (trace/after.py remembers the copy, as an out-of-place masked_fill's): nan-spread at the
    next layer's real queries of the left-padded row, and zeroing-lost names the guard; reading the copy is quiet."""
    name = "where_isnan_weights_computed_but_product_reads_the_softmax"
    found = check_bug(tmp_path, name, "nan-spread", NANS)
    real = [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert tuple(found[0]["cell"]) == first((2, 5, 5), lambda b, q, k: real[b][q] and not real[b][k] and k <= q), found
    status, found, report = traced(tmp_path, name, False, NANS)
    assert any(f["code"] == "zeroing-lost" and "out-of-place where / nan_to_num" in f["message"] for f in found), report
    status, found, report = traced(tmp_path, name, True, NANS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
