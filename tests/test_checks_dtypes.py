"""checks/dtypes.py (with maskcli/trace/overflow.py, which marks what overflowed while the program ran): a finite fill
that became -inf in the compute dtype, and a bool mask added to the scores, on reproductions of published bugs, and quiet
where nothing overflowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import maskcli
from checkbugs import check_bug
from maskcli.checks.registry import severity

FILLS = Path(__file__).parent / "data" / "fills"

BUGS = [
    ("opt_fp16_min_fill_overflow", "fill-became-inf"),  # huggingface/transformers#17433, fixed by #17437
    ("flax_fp16_bias_cast_inf", "fill-became-inf"),  # google/flax#982, fixed by #1414 / #1527
    ("mmdet_bool_mask_added", "bool-added"),  # open-mmlab/mmdetection#12351
    ("onnxscript_bool_mask_added", "bool-added"),  # microsoft/onnxscript#580, fixed by #656
    # coleygroup/DiffMS#25 (fixed by #26, blind-cq): the MIST encoder builds a -inf mask from its bool key padding mask
    # but adds the bool itself in place (`attn += attn_mask`), so padded peaks are attended
    ("diffms_mist_spectra_encoder_bool_padding_mask_added_not_neg_inf", "bool-added"),
    ("mist_peak_attention_bool_key_padding_added_to_scores", "bool-added"),  # the same bug, reproduced before
    # huggingface/pytorch-image-models PR #2686 (commit 61a26c7, blind-ct): the non-fused Attention adds the caller's
    # bool keep-mask over [cls, registers, patches] to the scores (+1/0), so padded patches stay attended
    ("timm_vit_reg_tokens_bool_attn_mask_added_as_bias_unfused", "bool-added"),
    # TransformerLensOrg/TransformerLens#1198 (commit 42a2d52, blind-dc): JointQKVAttentionBridge._reconstruct_attention
    # adds HF's boolean 4D mask (True = attend) to the scores, so a left-padded row attends to its pad keys
    ("transformerlens_joint_qkv_bridge_bool_4d_mask_added_as_bias", "bool-added"),
    ("eager_gqa_bool_sdpa_mask_added_right_padded", "bool-added"),  # the same bug: torch.add, GQA, right padded
    # NUS-HPC-AI-Lab/VideoSys#116 (issue #115, commit e0f7123; blind-ea): MultiHeadCrossAttention.torch_impl fills a bool
    # mask with -1e9 on the real T5 tokens (True == +1) and adds it: the padded keys are never masked, at a cross-attention
    # site that masks nowhere else
    ("opendit_stdit_cross_attention_bool_mask_adds_one_to_valid_tokens", "bool-added"),
    # NVIDIA-NeMo/Automodel#2116 (commit 2afd94eed; blind-ne, caught before tuning): Gemma 4 neat packing hands the
    # collator's bool 4-D block-causal mask through create_causal_mask unchanged, and eager attention adds it (+1 / +0)
    ("automodel_gemma4_neat_packing_bool_4d_mask_added_eager", "bool-added"),
]


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


def traced(program) -> list:
    with maskcli.trace() as t, torch.no_grad():
        program()
    return [(f.code, severity(f), f.message) for group in t.groups() for f in group.findings]


def test_the_values_that_overflow_are_the_ones_torch_rounds_to_inf():
    # IEEE rounding as torch casts and adds (c10/util/Half.h, BFloat16.h: round to nearest even): the reference the
    # trace's watch relies on, written here so that a torch that saturated instead would fail this test first
    assert torch.tensor(-1e10).half() == float("-inf")
    assert torch.tensor(torch.finfo(torch.float32).min).bfloat16() == float("-inf")
    low = torch.tensor(torch.finfo(torch.float16).min, dtype=torch.float16)
    assert low + torch.tensor(-15.0, dtype=torch.float16) == low  # under half an ulp (32): back to finfo.min
    assert low + torch.tensor(-16.0, dtype=torch.float16) == float("-inf")  # a tie, to even: past the range


def test_two_min_planes_summed_in_bfloat16_are_suspicious_under_sdpa():
    """Two masks of finfo(bfloat16).min added, -inf where both mask: a 2-D padding mask over queries and keys (a padded
    query's row masked whole) and a plane over query rows: the padded query's row is -inf only. SDPA gives the rows of
    -inf only 0 (aten/src/ATen/native/transformers/attention.cpp _safe_softmax), so nothing is NaN here, but a plain
    softmax over the same mask is: suspicious, with the line that summed them, and exit status 0."""
    def program():
        dtype, length = torch.bfloat16, 4
        low = torch.finfo(dtype).min
        real = torch.tensor([[1, 1, 1, 0]], dtype=dtype)
        both = (1 - real[:, None, :, None] * real[:, None, None, :]) * low
        rows = (1 - real)[:, None, :, None] * low
        q = torch.randn(1, 1, length, 4, dtype=dtype)
        F.scaled_dot_product_attention(q, q, q, attn_mask=both + rows)

    found = [f for f in traced(program) if f[0] == "fill-became-inf"]
    assert len(found) == 1 and found[0][1] == "suspicious", found
    assert "+ another mask in bfloat16 became -inf" in found[0][2] and "torch.where" in found[0][2], found


def test_an_additive_mask_converted_again_is_told_as_a_product_by_the_number():
    """unslothai/unsloth#3034's `(1.0 - mask) * finfo.min` over a mask already 0 / finfo.min: its kept cells become
    finfo.min and its masked ones (1 - finfo.min) * finfo.min, past the range: -inf. The trace is handed torch's `mul`
    while torch's attributes are its wrappers: the op is still a product, said with the number it was scaled by."""
    def program():
        low = torch.finfo(torch.float32).min
        additive = torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), low)[None, None]
        again = (1.0 - additive) * low
        reference = torch.where(additive == 0, torch.tensor(low), torch.tensor(float("-inf")))  # cell by cell
        assert torch.equal(again, reference)
        q = torch.randn(1, 1, 4, 8)
        F.scaled_dot_product_attention(q, q, q, attn_mask=again)

    found = [f for f in traced(program) if f[0] == "fill-became-inf"]
    assert len(found) == 1 and found[0][1] == "suspicious", found
    assert "3.40282e+38 x -3.40282e+38 in float32 became -inf" in found[0][2], found
    assert "converted again" in found[0][2], found


def test_a_causal_plane_plus_a_padding_plane_of_min_is_quiet():
    """NVIDIA-NeMo/Automodel#2658's builder: a causal plane and a padding plane of finfo(bfloat16).min added, -inf where
    both mask. The causal plane keeps each query's own key (0), so no row of the sum can be -inf only, whatever the
    padding (a padded key plus a kept cell stays finfo.min): no softmax over it is NaN, and the -inf cells mask what the
    fill masked anyway (SpecForge's old LLaMA `_expand_mask + _make_causal_mask` in float32, the same sum). Quiet."""
    def program():
        dtype, length = torch.bfloat16, 4
        low = torch.finfo(dtype).min
        causal = torch.full((length, length), low, dtype=dtype).triu(1)[None, None]
        padding = (1 - torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]], dtype=dtype))[:, None, None, :] * low
        q = torch.randn(2, 1, length, 4, dtype=dtype)
        mask = causal + padding
        for b in range(2):  # (the reference: every row of the sum holds a finite cell, its own key's at least)
            for i in range(length):
                assert any(bool(torch.isfinite(mask[b, 0, i, j])) for j in range(length))
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        scores = (q @ q.transpose(-1, -2)).float() + mask.float()
        assert not torch.isnan(scores.softmax(-1)).any()  # (a plain softmax over it: no NaN row)

    assert not [f for f in traced(program) if f[0] == "fill-became-inf"]


def test_a_min_fill_plus_scores_that_leaves_every_row_a_finite_cell_is_quiet():
    # finfo(float16).min + a score below -16 is -inf in cells already masked; each row keeps its own key: no NaN
    def program():
        scores = -40 * torch.ones(1, 1, 3, 3, dtype=torch.float16)
        mask = torch.full((3, 3), torch.finfo(torch.float16).min, dtype=torch.float16).triu(1)
        torch.softmax(torch.matmul(scores, scores.transpose(-1, -2)) * -1 + mask, dim=-1)

    assert [f for f in traced(program) if f[0] == "fill-became-inf"] == []


def test_a_fill_that_was_minus_inf_already_is_no_overflow():
    # masked_fill with -inf and a cast of -inf: nothing finite became -inf (the softmax's NaN rows are fully-masked's)
    def program():
        scores = torch.randn(1, 1, 3, 3)
        mask = torch.tensor([[False] * 3, [True, False, False], [True, True, False]])[None, None]
        torch.softmax(scores.masked_fill(~mask, float("-inf")).half().float(), dim=-1)

    found = traced(program)
    assert [f for f in found if f[0] == "fill-became-inf"] == [] and ("fully-masked", "suspicious") in [f[:2] for f in found]


def test_a_bool_mask_used_as_a_fill_is_no_bool_added():
    # masked_fill(~keep, -inf) reads the bool as a mask (torch/_tensor_docs.py masked_fill_): nothing is added
    def program():
        scores = torch.randn(1, 1, 4, 4)
        keep = torch.ones(4, 4, dtype=torch.bool).tril()
        torch.softmax(scores.masked_fill(~keep, float("-inf")) + torch.zeros(4, 4), dim=-1)

    assert [f for f in traced(program) if f[0] == "bool-added"] == []


def test_the_watch_changes_nothing_the_program_computes():
    # the same values, NaN where the program's own arithmetic makes NaN, with the watch on and off; a sparse tensor's
    # sum (which the watch cannot read) runs as it would
    def program():
        scores = torch.randn(2, 1, 4, 4, dtype=torch.float16) * 30
        mask = torch.full((4, 4), -1e10).to(torch.float16).triu(1)
        mask[0] = float("-inf")
        sparse = torch.eye(3).to_sparse() + torch.eye(3).to_sparse()
        return torch.softmax(scores + mask, dim=-1), sparse.to_dense()

    torch.manual_seed(0)
    plain = program()
    torch.manual_seed(0)
    with maskcli.trace() as t:
        watched = program()
    for a, b in zip(plain, watched):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
    assert t.calls and t.calls[0].details.get("overflow", {}).get("op") == "cast"


def test_a_min_sum_clamped_back_before_the_softmax_is_quiet():
    # two finfo.min planes summed (-inf where both mask), then clamp(min=finfo.min) as SpecForge's
    # _prepare_decoder_attention_mask does: the softmax's scores hold no -inf (torch.isinf says so), nothing to say
    def program():
        low = torch.finfo(torch.float32).min
        causal = torch.full((4, 4), low).triu(1)[None, None]
        padding = (1.0 - torch.tensor([[1.0, 1, 1, 0]]))[:, None, None, :] * low
        mask = (causal + padding).clamp(min=low)
        assert not torch.isinf(mask).any()
        torch.softmax(torch.randn(1, 1, 4, 4) + mask, dim=-1)

    assert [f for f in traced(program) if f[0] == "fill-became-inf"] == []


def test_a_min_sum_put_back_in_place_before_sdpa_is_quiet():
    """OLMo's model.py: causal bias + padding bias, each finfo.min, overflow to -inf where both mask, and
    ensure_finite_ puts finfo.min back in place (masked_fill_) before the bias reaches SDPA: the mask SDPA gets holds
    no -inf (the reference: torch.isneginf at the call), so no fill became -inf there. (OLMo's causal plane keeps a
    cell in every row, so its sum is quiet unrepaired too; a plane of padded query rows in its place is said
    unrepaired, as the test above.)"""
    def program(repair, causal_plane=False):
        low = torch.finfo(torch.float32).min
        real = torch.tensor([[1.0, 1, 1, 0]])
        causal = torch.full((4, 4), low).triu(1)[None, None] if causal_plane else (1 - real)[:, None, :, None] * low
        padding = (1 - real[:, None, :, None] * real[:, None, None, :]) * low
        bias = causal + padding
        if repair:
            bias.masked_fill_(bias == float("-inf"), low)
            assert not torch.isneginf(bias).any()
        q = torch.randn(1, 2, 4, 8)
        F.scaled_dot_product_attention(q, q, q, attn_mask=bias)

    assert [f for f in traced(lambda: program(True)) if f[0] == "fill-became-inf"] == []
    found = [f for f in traced(lambda: program(False)) if f[0] == "fill-became-inf"]
    assert len(found) == 1 and found[0][1] == "suspicious", found
    assert [f for f in traced(lambda: program(False, causal_plane=True)) if f[0] == "fill-became-inf"] == []


def test_litgpt_softcapping_adds_its_bool_mask_cache_to_the_scores(tmp_path):
    """Lightning-AI/litgpt#1672 (written blind, caught before any rule was changed for it): the softcapping branch
    adds the bool mask_cache to the scores (True + score: nothing masked), so a prefill into the 8-slot KV cache sees
    slots no token was written to yet. The fix (masked_fill) is quiet."""
    found = check_bug(tmp_path, "litgpt_softcapping_bool_mask_added_to_scores", "bool-added")
    assert found


def test_mlx_lm_gemma2_softcap_attention_adds_bool_mask(tmp_path):
    """ml-explore/mlx-lm#27 (1dc5de4): Gemma 2's soft-capped attention adds the bool causal mask to the scores, so
    nothing is masked (written blind, batch blind-ae, a torch port; caught before any rule was changed for it). The
    fix (the mask turned additive) is quiet."""
    check_bug(tmp_path, "mlx_lm_gemma2_softcap_attention_adds_bool_mask", "bool-added")


def test_a_bool_mask_added_in_place_to_left_padded_scores_is_said_at_its_line(tmp_path):
    """The DiffMS bug written another way: a trajectory encoder's (B, 1, 1, L) `valid` flags (True = real, left-padded)
    added with `scores.add_(...)` to matmul scores, where the -1e9 bias built beside it was meant; its fix is quiet. The
    reference: torch's own promotion, a bool added to float scores shifts each cell by 0 or 1, so no cell is masked."""
    scores = torch.zeros(1, 4)
    scores.add_(torch.tensor([[True, False, True, False]]))
    assert scores.tolist() == [[1.0, 0.0, 1.0, 0.0]] and torch.softmax(scores, -1).min() > 0
    [hit] = check_bug(tmp_path, "trajectory_valid_flags_added_in_place", "bool-added", folder=FILLS)
    assert "(3, 1, 1, 6)" in hit["message"] and "trajectory_valid_flags_added_in_place.py:27" in hit["message"]


def test_a_bool_pair_mask_added_in_front_of_padded_patch_scores_is_said_at_its_line(tmp_path):
    """timm PR #2686's bug (a bool keep-mask added to the non-fused path's scores) written another way: a NaFlex-style
    tower's (B, 1, N, N) pair mask over images of 6, 4 and 3 patches, added in front (`bias + q @ kᵀ`); its fix (a
    0 / -inf bias) is quiet. The reference: torch's promotion shifts each kept cell by 1, so no padded patch is masked."""
    keep = torch.tensor([True, True, False])
    assert torch.softmax(keep + torch.zeros(3), -1)[2] > 0
    [hit] = check_bug(tmp_path, "naflex_pair_keep_mask_added_before_scores", "bool-added", folder=FILLS)
    assert "(3, 1, 6, 6)" in hit["message"] and "naflex_pair_keep_mask_added_before_scores.py:34" in hit["message"]


def test_an_in_place_add_of_a_float_mask_or_of_a_bool_outside_the_scores_is_no_bool_added():
    # `scores += (~keep) * -1e9` adds a float; a bool added in place to a float tensor that is no q @ kᵀ (a counter)
    # adds to no scores: neither is said
    def program():
        q = torch.randn(1, 1, 4, 8)
        scores = q @ q.transpose(-1, -2)
        keep = torch.ones(4, 4, dtype=torch.bool).tril()
        scores += (~keep).float() * -1e9
        counts = torch.zeros(4, 4)
        counts += keep
        torch.softmax(scores, dim=-1)

    assert [f for f in traced(program) if f[0] == "bool-added"] == []


def test_bionemo_esm1nv_core_attention_adds_boolean_mask(tmp_path):
    """NVIDIA/bionemo-framework beca937 (written blind, batch blind-df; caught before any rule was changed for it):
    with use_esm_attention, ESM-1nv's core attention adds NeMo's (B, 1, S, S) boolean mask (True = masked) to the
    baddbmm scores, +1 on padded residues, so nothing is masked. The fix (the key row times -3.4e38) is quiet. The
    reference: torch's promotion, a bool added to float scores shifts each cell by 0 or 1, so no cell is masked."""
    assert torch.softmax(torch.zeros(3) + torch.tensor([False, True, True]), -1).min() > 0
    [hit] = check_bug(tmp_path, "bionemo_esm1nv_core_attention_adds_boolean_mask", "bool-added")
    assert "(3, 1, 16, 16)" in hit["message"], hit
    assert "bionemo_esm1nv_core_attention_adds_boolean_mask.py:94" in hit["message"], hit


def test_a_key_padding_mask_added_to_unfolded_bmm_scores_is_said_at_its_line(tmp_path):
    """The bionemo ESM-1nv bug written another way: a fair-esm style ESM-1b, time-major with the heads folded into
    the batch for bmm, adds its (B, 1, 1, S) key_padding_mask (`tokens.eq(padding_idx)`, True = padding) to the
    unfolded scores; its fix (masked_fill with -inf) is quiet. The reference: torch's promotion gives a padded key
    1 more, never -inf, so its weight stays above 0."""
    scores = torch.zeros(1, 1, 1, 3) + torch.tensor([False, False, True]).unsqueeze(0).unsqueeze(1).unsqueeze(2)
    assert scores.dtype == torch.float32 and torch.softmax(scores, -1)[..., 2].item() > 1 / 3
    [hit] = check_bug(tmp_path, "esm1b_key_padding_mask_added_to_folded_scores", "bool-added", folder=FILLS)
    assert "(3, 1, 1, 10)" in hit["message"], hit
    assert "esm1b_key_padding_mask_added_to_folded_scores.py:42" in hit["message"], hit


def test_a_bool_bias_filled_on_the_pads_of_a_cross_attention_masks_nothing(tmp_path):
    """VideoSys#116's bug (a bool tensor filled with a large negative, then added) written another way: a captioning
    decoder's cross-attention over left-padded text, 3-D (B*H, N, L) scores, the bias `masked_fill_(~keep, -1e4)` on
    the pads, repeated over the heads and added by torch.add; the site masks nowhere else. Its fix (the bias in the
    scores' dtype) is quiet. The reference: torch stores -1e4 in a bool as True, and True adds 1, so a pad keeps weight."""
    bias = torch.zeros(1, 3, dtype=torch.bool).masked_fill_(torch.tensor([[True, False, False]]), -1e4)
    assert bias.tolist() == [[True, False, False]] and torch.softmax(torch.zeros(1, 3) + bias, -1)[0, 0] > 0
    [hit] = check_bug(tmp_path, "audio_caption_cross_attention_bool_bias_left_padded", "bool-added", folder=FILLS)
    assert "(12, 1, 8)" in hit["message"] and "audio_caption_cross_attention_bool_bias_left_padded.py:32" in hit["message"]


def test_espresso_streaming_chunk_mask_added_as_bool_to_relative_position_scores(tmp_path):
    """freewym/espresso f823f17e (written blind, batch blind-lv; caught before any rule was changed for it): the
    streaming encoder's chunk mask stayed bool, `masked_fill(..., -1e8)` left it so, and the relative-position path
    added it to the scores: +1 on the keys it meant to hide. The fix casts it to the scores' dtype first."""
    found = check_bug(tmp_path, "espresso_chunk_streaming_bool_attn_mask_added_to_scores", "bool-added")
    assert "a bool mask (1, 12, 12) is added to the scores" in " ".join(found[0]["message"].split())


def test_torchtext_roberta_bool_mask_masked_fill_stays_bool(tmp_path):
    """pytorch/text#1454 (written blind, batch blind-pd; caught before any rule changed for it): torchtext's RoBERTa
    encoder turned its bool causal mask (True = hidden) "additive" with `attn_mask.masked_fill(attn_mask, -1e8)`, which
    keeps it bool, and `attn_weights += attn_mask` then adds 1 to every hidden key. The fix builds a float mask."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "torchtext_roberta_bool_attn_mask_masked_fill_stays_bool", "bool-added")[0]
    tokens = 8  # (its batch's padded length: the causal mask is triu(ones(8, 8), 1).bool())
    assert hit["message"].startswith(f"a bool mask (1, {tokens}, {tokens}) is added to the scores")


def test_paligemma_from_scratch_adds_its_bool_prefill_mask_to_the_scores(tmp_path):
    """YYZhang2025/Pali-Gemma 55a5faf (written blind, blind-qc, caught before tuning): the prefill mask, a bool of
    causal AND padding, is added to the scores (+1 / +0), so targets see later tokens and the padding; the fix fills
    -inf where it is False."""
    check_bug(tmp_path, "paligemma_scratch_bool_mask_added_to_scores", "bool-added")
