"""checks/maskmean.py (fed by trace/maskmean.py): a sum over a batch's positions divided by a 0/1 mask's sum whose summed
values are not 0 where the mask leaves them out, on a reproduction of a published bug (rerankers' ColBERT MaxSim over
the query's [MASK] tokens) and on the same bug written otherwise (a right-padded BERT's mean pooling, `torch.sum` over a
clamped count), both fixes quiet; found_in against a loop over rows and positions. mean-counts-padding, its mirror: a mean over the
positions of values zeroed at the padding (UER-py's sentence vectors, and a left-padded SDPA encoder's masked_fill),
both fixes quiet. mean-over-padding: a plain mean over the positions, nothing zeroed, of a batch whose padding the model
call states (lobster's UME embedding, written blind; an nn.MultiheadAttention classifier), both fixes quiet."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from checkbugs import check_bug
from maskcli.trace.maskmean import found_in

MASKMEAN = Path(__file__).parent / "data" / "maskmean"


def test_colbert_maxsim_summed_over_masked_query_tokens_is_flagged_and_its_fix_is_not(tmp_path):
    # AnswerDotAI/rerankers #75 / PR #76: _colbert_score summed the per-token MaxSim over every query position, the
    # [MASK] augmentation (attention_mask 0) too, and divided by q_mask.sum()
    [hit] = check_bug(tmp_path, "rerankers_colbert_score_query_mask_not_applied", "mean-counts-masked")[:1]
    assert "(1, 14) mask's sum" in hit["message"] and "positions 6, 7" in hit["message"]


def test_mean_pooling_that_sums_the_padding_is_flagged_and_the_masked_sum_is_not(tmp_path):
    [hit] = check_bug(tmp_path, "bert_mean_pooling_sum_over_padding_divided_by_lengths", "mean-counts-masked",
                      MASKMEAN)[:1]
    assert "batch row 1 sums values at positions 3, 4, 5, 6" in hit["message"]


def test_unimol_coord_head_sums_padded_atom_pairs(tmp_path):
    # deepmodeling/Uni-Mol#211 (commit 7394647; written blind, batch blind-ee): the masked-coordinate head divides each
    # pair's delta_pos by atom_num (counted from `1 - padding_mask`), weighs it by pair2coord_proj and sums over the
    # pairs, the padded atoms' too; the fix multiplies by the pair mask first (and counts atom_num without the - 1)
    [hit] = check_bug(tmp_path, "unimol_coord_head_padded_atoms_not_pair_masked", "mean-counts-masked")[:1]
    # the program's own batch: molecules of 7 and 15 tokens padded to 16: row 0's pads are 7..15
    message = " ".join(hit["message"].split())
    assert "(2, 16) mask's sum (each term divided before the sum)" in message
    assert "batch row 0 sums values at positions " + ", ".join(str(p) for p in range(7, 15)) + ", ..." in message


def test_egnn_coordinate_update_mean_over_padded_nodes(tmp_path):
    # written another way: an E(n)-equivariant block over left-padded molecules (bool node_mask, 9, 5 and 7 atoms of 9)
    # whose coordinate update `(diff * weight / count).sum(2)` sums the padded atoms' differences; the fix weighs them 0
    [hit] = check_bug(tmp_path, "egnn_coordinate_update_mean_over_padded_nodes", "mean-counts-masked", MASKMEAN)[:1]
    message = " ".join(hit["message"].split())
    assert "batch row 1 sums values at positions " + ", ".join(str(p) for p in range(9 - 5)) + " the mask" in message


def test_uer_mean_pooling_over_zeroed_padding_is_flagged_and_the_sum_over_the_count_is_not(tmp_path):
    # dbiir/UER-py#190 (commit 22147b5; written blind, batch blind-gn): FeatureExtractor zeroes the padded positions
    # (`output * seg`) and pools with `torch.mean(output, dim=1)`, dividing by seq_length (12); the fix divides the sum
    # by `seg.sum(1)`. The program's first batch: sentences of 5 and 11 tokens ([CLS] + 4, [CLS] + 10)
    found = check_bug(tmp_path, "uer_py_extract_features_mean_pooling_counts_padding", "mean-counts-padding")
    message = " ".join(found[0]["message"].split())
    assert "batch row 0: a mean over axis 1 of a (2, 12, 32) tensor divides by all 12 positions" in message
    assert "0 at exactly the positions 5, 6, 7, 8, 9, 10, 11 the attention call before it masks as padding" in message
    assert len(found) == 2  # each of the two batches (each one model call) pools its own padding


def test_left_padded_encoder_masked_fill_then_mean_is_flagged(tmp_path):
    # written another way: SDPA with a boolean key mask over a left-padded batch (3, 7 and 5 tokens of 7), the pads
    # zeroed by masked_fill and pooled with `.mean(-2)`; the fix divides the sum by attention_mask.sum(-1)
    [hit] = check_bug(tmp_path, "sdpa_encoder_left_padded_masked_fill_zero_then_mean", "mean-counts-padding", MASKMEAN)
    message = " ".join(hit["message"].split())
    assert "batch row 0: a mean over axis 1 of a (3, 7, 24) tensor" in message
    assert "positions 0, 1, 2, 3 the attention call before it masks as padding (4 of 7)" in message


def _reference(values: np.ndarray, mask: np.ndarray):
    for row in range(mask.shape[0]):
        if not any(mask[row]):
            continue
        out = [p for p in range(mask.shape[1]) if not mask[row, p] and any(v != 0 for v in values[row, p].ravel())]
        if out:
            return row, out
    return None


def test_found_in_matches_a_loop_over_rows_and_positions():
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows, length = int(rng.integers(1, 4)), int(rng.integers(1, 6))
        mask = rng.random((rows, length)) < 0.6
        values = rng.normal(size=(rows, length, 2)) * (rng.random((rows, length, 1)) < 0.5)
        if rng.random() < 0.5:
            values = values * mask[..., None]  # the fix: 0 wherever the mask leaves a position out
        assert found_in(values, mask) == _reference(values, mask)


def test_a_scripted_function_calling_torch_sum_compiles_and_runs_while_sums_are_watched(tmp_path):
    # `sum` is watched for masked means: torch.sum is then a wrapper, which TorchScript must still read as aten::sum
    # (axolotl's @torch.jit.script get_max_seqlen_in_batch); the scripted result checked against torch's own
    import json

    from typer.testing import CliRunner

    from maskcli.commands import app

    program = tmp_path / "scripted_sum.py"
    program.write_text(
        "import torch\n"
        "import torch.nn.functional as F\n\n"
        "@torch.jit.script\n"
        "def lengths(mask: torch.Tensor) -> torch.Tensor:\n"
        "    return torch.sum(mask, dim=-1)\n\n"
        "mask = torch.tensor([[1, 1, 0], [1, 1, 1]])\n"
        "assert lengths(mask).tolist() == [2, 3]\n"
        "q = torch.randn(2, 1, 3, 4)\n"
        "F.scaled_dot_product_attention(q, q, q, attn_mask=mask.bool()[:, None, None, :])\n")
    out = tmp_path / "scripted_sum.json"
    result = CliRunner().invoke(app, ["trace", "--json", str(out), str(program)])
    assert json.loads(out.read_text())["exit_status"] == 0, result.output


def test_a_count_of_the_valid_positions_as_the_length_less_the_padding_flags():
    # multicenter-sepsis' loss: `loss.sum(-1) / (L - invalid.sum(-1))`, the sum zeroed at the invalid (True) steps,
    # divides by the count of the positions the flags leave out: quiet; the same count under a sum that keeps the
    # invalid steps' values is said at them. The reference: the padded positions of row 1, written out.
    import torch
    import torch.nn.functional as F

    import maskcli

    torch.manual_seed(0)
    invalid = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    x = torch.rand(2, 5) + 0.5  # (no value 0: every position summed is one the sum holds)
    q = torch.randn(2, 1, 5, 4)
    with maskcli.trace() as t:
        F.scaled_dot_product_attention(q, q, q, attn_mask=~invalid[:, None, None, :])
        good = x.masked_fill(invalid, 0.0).sum(-1) / (invalid.shape[-1] - invalid.sum(-1))
        assert t.calls[-1].details.get("masked_mean") is None
        bad = x.sum(-1) / (invalid.shape[-1] - invalid.sum(-1))
    [said] = t.calls[-1].details["masked_mean"]
    assert said["row"] == 1 and said["positions"] == [3, 4]
    assert torch.allclose(good, torch.stack([x[0].mean(), x[1, :3].mean()])) and not torch.allclose(good, bad)


def test_a_plain_mean_over_a_padded_batch_is_flagged_and_the_masked_mean_is_not(tmp_path):
    """Written otherwise: nn.MultiheadAttention handed key_padding_mask, a residual and a feed-forward, then
    `h.mean(dim=1)` over a right-padded batch (lengths 7, 4, 2 of 7). Against a loop over rows: the first row with real
    and padded positions is row 1, its pads 4 .. 6."""
    [hit] = check_bug(tmp_path, "mha_classifier_mean_pool_over_padding", "mean-over-padding", MASKMEAN)
    lengths, width = [7, 4, 2], 7
    row = next(r for r, n in enumerate(lengths) if 0 < n < width)
    pads = [p for p in range(width) if p >= lengths[row]]
    message = " ".join(hit["message"].split())
    assert f"batch row {row}: a mean over axis 1 of a (3, 7, 16) tensor averages all {width} positions" in message
    assert f"the padding at positions {', '.join(map(str, pads))} among them ({len(pads)} of {width})" in message
    assert hit["expected"] == f"row {row}'s mean over its {width - len(pads)} real positions"


def test_lobster_ume_embedding_mean_pooled_over_its_padding(tmp_path):
    """prescient-design/lobster#149 (written blind): UME.embed pooled the encoder's padded output with
    `embeddings.mean(dim=1)`; the fix sums over the attention_mask and divides by its count."""
    [hit] = check_bug(tmp_path, "lobster_ume_embed_mean_pool_over_padding", "mean-over-padding")
    assert "averages all 24 positions, the padding at positions 12," in " ".join(hit["message"].split())


def test_lightrag_hf_embed_mean_pooled_over_its_padding(tmp_path):
    """HKUDS/LightRAG#3675 (written blind, batch blind-ls; caught before any rule was changed for it): `hf_embed` took
    `last_hidden_state.mean(dim=1)` of a right-padded BERT batch; the fix averages over the attention mask."""
    [hit] = check_bug(tmp_path, "lightrag_hf_embed_mean_over_padded_batch", "mean-over-padding")[:1]
    assert "averages all 27 positions, the padding at positions 10," in " ".join(hit["message"].split())


def test_presto_eval_embedding_averages_the_padded_slots_of_dropped_tokens(tmp_path):
    """WorldCereal/presto-worldcereal 5ea0fc2 (written blind, batch blind-lr; caught once a padded tail the model's own
    attention hides from every query counts as the padding it states): the encoder dropped each pixel's masked tokens,
    padded the rest to the longest and masked that padding in attention, then returned `x.mean(dim=1)` over every slot.
    The fix averages over the kept tokens."""
    [hit] = check_bug(tmp_path, "presto_worldcereal_encoder_mean_pools_padded_masked_token_slots", "mean-over-padding")[:1]
    assert "which the model's attention hides from every query" in " ".join(hit["message"].split())


def test_an_mae_encoder_mean_pools_the_padding_it_made_itself(tmp_path):
    """Written another way (tests/data/maskmean): an MAE-style encoder keeps each sample's visible patches, pads them to
    the longest inside its forward (`key_padding_mask` to nn.MultiheadAttention), and returns `x.mean(dim=1)`: the
    model call states no padding; its attention hides the padded tail (3 of 10 slots real in row 1) from every query,
    the unclouded row whole. The fix averages over the kept slots."""
    [hit] = check_bug(tmp_path, "mae_encoder_kept_tokens_padded_mean_pooled_whole", "mean-over-padding", MASKMEAN)[:1]
    row, pad, _ = hit["cell"]
    assert row == 1 and "the padding at positions 3, 4, 5, 6, 7, 8, 9" in " ".join(hit["message"].split())


def test_bert_as_service_reduce_mean_over_the_zero_padding(tmp_path):
    """jina-ai/clip-as-service#93 (written blind, batch blind-md; caught before any rule changed for it): every input
    padded to 25 tokens, and REDUCE_MEAN / REDUCE_MAX taken over all 25 positions of BERT's second-to-last layer. The
    fix masks the padding out of both reductions."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "bert_as_service_reduce_mean_max_pools_zero_padding", "mean-over-padding")[0]
    assert "a mean over axis 1 of a (4, 25, 32) tensor averages all 25 positions" in " ".join(hit["message"].split())
