"""checks/kernels.py: the kernels' own rules, each on a reproduction of a published bug (its buggy and fixed code)."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkbugs import check_bug, traced

CACHES = Path(__file__).parent / "data" / "caches"

BUGS = [
    # pytorch/pytorch#144858: is_causal=True at a decode step is top-left (torch/nn/functional.py
    # scaled_dot_product_attention: attn_mask = torch.ones(L, S).tril(diagonal=0) where is_causal)
    ("sdpa_is_causal_decode", "top-left-causal"),
    # lucidrains/x-transformers#187: is_causal=causal kept for the one new query behind a cache
    ("cached_decode_is_causal_xtransformers", "top-left-causal"),
    # onnx/onnx#8068, Dao-AILab/flash-attention#282: a chunked prefill's is_causal against its cache is top-left
    ("chunked_prefill_is_causal", "top-left-causal"),
    # pytorch/pytorch#99282: MHA's is_causal is a hint; with need_weights it applies attn_mask (torch/nn/functional.py
    # multi_head_attention_forward: is_causal is passed to SDPA only "if is_causal and key_padding_mask is None and
    # not need_weights")
    ("mha_is_causal_need_weights", "hint-ignored"),
    # huggingface/transformers#542, #5295: a 0/1 mask added to the scores masks nothing
    ("bert_mask_not_extended", "ones-added"),
    # pytorch/pytorch#27968: MHA's own softmax over a row whose keys are all padding is NaN
    ("mha_empty_sequence_nan", "fully-masked"),
    # written blind (batch blind-ap): deepspeedai/DeepSpeed#2851: BLOOM inference adds the float 0/1 padding mask raw
    ("deepspeed_inference_bloom_float_padding_mask_not_converted", "ones-added"),
    # written blind (batch blind-dq): huggingface/optimum#1416: BetterTransformer's GPT-BigCode SDPA took is_causal
    # for batch 1 and several new tokens on top of a KV cache (top-left over the cached prefix)
    ("optimum_bettertransformer_gpt_bigcode_cached_multitoken_is_causal_top_left", "top-left-causal"),
    # written blind (batch blind-dx): baudm/parseq 056c792 (fixing 970f266): generate_attn_masks fills a float zeros
    # mask with True, +1.0 on the keys nn.MultiheadAttention was to block in the permutation training masks
    ("parseq_training_perm_attn_masks_float_true_not_masked", "ones-added"),
    # written blind (batch blind-dx): baudm/parseq 056c792: ABINet's _get_location_mask fills the float eye with True
    # (+1.0) where -inf was meant, the BCN cross-attention's memory_mask (a cross-attention call)
    ("parseq_abinet_bcn_location_mask_plus_one_not_neg_inf", "ones-added"),
    # written blind (batch blind-eu): kohya-ss/sd-scripts 2b07a92c: Flux's DoubleStreamBlock joins the int T5 mask
    # with float ones for the image tokens, so SDPA adds a float 0/1 mask and the padded text stays attended
    ("sd_scripts_flux_double_block_t5_mask_float_added_as_bias", "ones-added"),
    # ibm-granite/dolomite-engine#63 (3aaba78; written blind, batch blind-hb; caught before any rule was changed for it):
    # transformers returned no SDPA mask for an unpadded batch at decode and the module passed is_causal=True over
    # the cache, so the new token saw the first prompt token alone
    ("dolomite_engine_sdpa_decode_is_causal_without_mask", "top-left-causal"),
    # huggingface/transformers#30311 (written blind, blind-ns, round 85, caught before any rule changed for it): with
    # no mask given, _ignore_causal_mask_sdpa dropped the causal mask for a 5-token verify step behind the cache
    ("transformers_sdpa_maskless_speculative_verify_is_causal_top_left", "top-left-causal"),
]


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


def test_rows_a_softmax_turns_into_nan_are_suspicious_and_a_finite_fill_a_note(tmp_path):
    """pytorch/pytorch#41508: a softmax of a row of -inf is NaN. The program may zero those rows after the softmax
    (transformers/models/cpmant/modeling_cpmant.py masks the weights with 0 again: a masked_fill with 0 over those
    rows the trace reads, test_checks_rows.py; another way, nan_to_num or a where, it may not): this program zeroes
    none, so it is suspicious, not wrong; the fix's finfo.min fill makes them uniform, a note."""
    status, found, report = traced(tmp_path, "softmax_inf_padding_nan", fixed=False)
    assert ("fully-masked", "suspicious") in [(f["code"], f["severity"]) for f in found] and status == 0, report
    status, found, report = traced(tmp_path, "softmax_inf_padding_nan", fixed=True)
    assert ("fully-masked", "note") in [(f["code"], f["severity"]) for f in found] and status == 0, report
    assert not [f for f in found if f["severity"] != "note"], report


def test_rows_that_see_no_key_are_a_note_where_the_kernel_gives_zero(tmp_path):
    """The padding query rows of a left-padded batch under SDPA see no key: routine (SDPA's math backend gives 0
    there, aten/src/ATen/native/transformers/attention.cpp _safe_softmax), a note, not a wrong finding."""
    status, found, report = traced(tmp_path, "prefill_mask_ignores_padding", fixed=True)
    assert status == 0
    assert [(f["code"], f["severity"]) for f in found] == [("fully-masked", "note")], report


def test_a_blind_reproduction_of_is_causal_on_a_continued_cache_is_flagged(tmp_path):
    """pytorch/executorch#21749, written blind (it caught before any rule was tuned for the blind split): every
    multi-token step of a reference cache ran SDPA is_causal, top-left over the history of a second chat turn."""
    check_bug(tmp_path, "executorch_reference_cache_continuation_is_causal", "top-left-causal")


def test_a_speculative_verify_step_with_is_causal_over_a_static_cache_is_flagged(tmp_path):
    """optimum#1416's bug written another way: a speculative decoder verifies 3 draft tokens of a batch of 2 against a
    preallocated static cache with SDPA's is_causal (set whenever more than one token is new), top-left over the
    cached prefix; the fix hands the bottom-right triangle ones(n, past + n).tril(past)."""
    found = check_bug(tmp_path, "speculative_verify_static_cache_is_causal", "top-left-causal", folder=CACHES)
    assert "3 queries and 9 keys" in found[0]["message"]


def test_a_float_mask_of_ones_alone_is_a_constant_not_a_keep_mask_added():
    """ones-added reads a float mask of 0s and 1s (a keep mask added: it masks the 1s' complement nowhere); one of 1s
    alone adds a constant, which masks nothing and changes no weight (Doge's dt_states bias at a decode step, whose
    fix was called ones-added): against softmax itself."""
    import torch

    from maskcli.trace.masks import _keep

    scores = torch.randn(1, 1, 3, 4)
    for mask, flagged in ((torch.ones(1, 1, 3, 4), False), (torch.tensor([[1.0, 1, 0, 0]]).expand(1, 1, 3, 4), True)):
        details = {}
        _keep(mask, details)
        changed = not torch.allclose(torch.softmax(scores + mask, -1), torch.softmax(scores, -1))
        assert details.get("zero_one", False) is flagged is changed


def test_mlx_vlm_vision_mask_of_additive_ones(tmp_path):
    """Blaizzy/mlx-vlm#704 (written blind, caught before any rule was tuned for it): the vision block mask built as
    0/1 floats and added to the scores, so it hides nothing."""
    check_bug(tmp_path, "mlx_vlm_qwen2_vl_vision_additive_ones_mask", "ones-added")


def test_qeff_gemma4_vision_patch_mask_added_as_zero_one(tmp_path):
    """quic/efficient-transformers#1159 item 3 (written blind): the patch validity added to eager scores as 1 (real)
    and 0 (padding), so padded patches stay attended; the fix adds finfo.min."""
    [hit] = check_bug(tmp_path, "qeff_gemma4_vision_padding_mask_added_as_zero_one", "ones-added")
    assert "added to these scores" in hit["message"]


def test_pad_flags_added_in_place_to_folded_heads_scores(tmp_path):
    """Written another way (tests/data/fixq2): heads folded into the batch (bmm), right-padded, the pad flags
    (1 = pad) added in place; -1e9 times them is quiet. What the 0/1 sum does to the weights, against softmax itself:
    a padded key keeps weight, where the fix's leaves it none."""
    check_bug(tmp_path, "encoder_added_pad_flags", "ones-added", Path(__file__).parent / "data" / "fixq2")
    import torch

    from maskcli.trace.scores import zero_one_seen

    scores = torch.randn(1, 3, 4)
    pad = torch.tensor([[[0.0, 0, 1, 1]]])
    assert torch.softmax(scores + pad, -1)[..., 2:].min() > 0.01
    assert torch.softmax(scores + pad * -1e9, -1)[..., 2:].max() == 0
    keep = torch.ones(1, 3, 4, dtype=torch.bool)
    assert zero_one_seen(pad == 1, scores, keep)
    assert not zero_one_seen(pad == 1, scores, keep & (pad == 0))  # (a fill beside it masks the padded keys: quiet)


def test_diffusers_chroma_float_attention_mask_added_not_masked(tmp_path):
    """huggingface/diffusers#12116 (fixed by #12263): Chroma's 0/1 text+image mask reaches SDPA as float, an additive
    +1/+0 that hides no padding (written blind, batch blind-x; caught before any rule was changed for it)."""
    check_bug(tmp_path, "diffusers_chroma_float_attention_mask_added_not_masked", "ones-added")


def test_sasrec_float_tril_added_by_multihead_attention(tmp_path):
    """pmixer/SASRec.pytorch aab3261 (written blind, batch blind-an): `torch.tril(torch.ones((tl, tl)))` handed to
    nn.MultiheadAttention as attn_mask: a float mask MHA adds (+1 / +0), so every item sees the later ones; the fix
    passes `~torch.tril(bool)`. Against nn.MultiheadAttention itself: the float tril masks no later key, the bool one
    masks them all."""
    [hit] = check_bug(tmp_path, "sasrec_pytorch_float_tril_attn_mask_adds_instead_of_blocks", "ones-added")
    assert "float attn_mask" in hit["message"]
    import torch

    torch.manual_seed(0)
    mha, x = torch.nn.MultiheadAttention(8, 1).eval(), torch.randn(4, 1, 8)
    _, added = mha(x, x, x, attn_mask=torch.tril(torch.ones(4, 4)))
    _, blocked = mha(x, x, x, attn_mask=~torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    later = torch.ones(4, 4, dtype=torch.bool).triu(1)
    assert added[0][later].min() > 0 and blocked[0][later].max() == 0


def test_float_key_padding_mask_added_by_multihead_attention(tmp_path):
    """Written another way (tests/data/mhafloat): a recommender's batch_first nn.MultiheadAttention over a right-padded
    batch, its key_padding_mask `(ids == 0).float()`, which MHA adds (+1 on a pad): the pads are attended; the bool
    mask is quiet. The finding names the argument."""
    [hit] = check_bug(tmp_path, "bst_float_key_padding_mask_added", "ones-added", Path(__file__).parent / "data" / "mhafloat")
    assert "float key_padding_mask" in hit["message"]


def test_pytorch_ts_float_triu_tgt_mask_added_by_the_transformer_decoder(tmp_path):
    """zalandoresearch/pytorch-ts d0a19ab (written blind, batch blind-cm): TransformerNetwork's `tgt_mask` buffer is
    the float `torch.triu(torch.ones(P, P), diagonal=1)`, which nn.Transformer's decoder adds (+1 on a later step), so
    the teacher-forced decoder reads the future targets; the fix uses generate_square_subsequent_mask (-inf above
    the diagonal). Against nn.TransformerDecoderLayer itself: the float triu leaves the later steps' weights > 0."""
    [hit] = check_bug(tmp_path, "pytorch_ts_transformer_tgt_mask_float_ones_added_not_blocking", "ones-added")
    assert "float attn_mask" in hit["message"]
    import torch

    torch.manual_seed(0)
    mha, x = torch.nn.MultiheadAttention(8, 1).eval(), torch.randn(5, 1, 8)
    _, added = mha(x, x, x, attn_mask=torch.triu(torch.ones(5, 5), diagonal=1))
    _, blocked = mha(x, x, x, attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(5))
    later = torch.ones(5, 5, dtype=torch.bool).triu(1)
    assert added[0][later].min() > 0 and blocked[0][later].max() == 0


def test_float_future_and_pad_flags_added_by_sdpa(tmp_path):
    """Written another way (tests/data/mhafloat): a hand-rolled forecasting decoder on SDPA over right-padded series,
    its float "hide" mask (triu(ones, 1) maxed with the padding flags, 1 = hidden) handed as attn_mask, which SDPA
    adds: the later steps and the padding are read. The bool keep mask `hide == 0` is quiet. Against SDPA itself."""
    [hit] = check_bug(tmp_path, "forecast_sdpa_float_future_and_pad_flags_added", "ones-added",
                      Path(__file__).parent / "data" / "mhafloat")
    assert "float attn_mask" in hit["message"]
    import torch

    q = torch.randn(1, 1, 4, 8)
    hide = torch.triu(torch.ones(4, 4), diagonal=1)
    weights = [torch.nn.functional.scaled_dot_product_attention(q, q, torch.eye(4)[None, None], attn_mask=m)
               for m in (hide, hide == 0)]
    later = hide.bool()
    assert weights[0][0, 0][later].min() > 0 and weights[1][0, 0][later].max() == 0


def test_float_eye_memory_mask_added_by_a_cross_attention(tmp_path):
    """Written another way (tests/data/mhafloat; parseq 056c792's ABINet location mask): a cloze corrector on
    nn.TransformerDecoder over a right-padded batch hands `torch.eye(T)` as the float memory_mask, which each
    cross-attention adds (+1 on a position's own character); the bool eye is quiet. Against nn.MultiheadAttention
    itself, its keys another tensor: the float eye leaves the diagonal its weight, the bool eye gives it none."""
    [hit] = check_bug(tmp_path, "cloze_decoder_float_eye_memory_mask_added", "ones-added",
                      Path(__file__).parent / "data" / "mhafloat")
    assert "float attn_mask" in hit["message"]
    import torch

    torch.manual_seed(0)
    mha, q, memory = torch.nn.MultiheadAttention(8, 1).eval(), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    _, added = mha(q, memory, memory, attn_mask=torch.eye(4))
    _, blocked = mha(q, memory, memory, attn_mask=torch.eye(4, dtype=torch.bool))
    own = torch.eye(4, dtype=torch.bool)
    assert added[0][own].min() > 0 and blocked[0][own].max() == 0


def test_float_hide_mask_filled_true_added_by_sdpa(tmp_path):
    """Written another way (tests/data/mhafloat; parseq 056c792's permutation masks): a permutation LM on SDPA over a
    left-padded batch fills a float zeros mask with True where a key comes later in the order or is padding, +1.0
    added; the -inf fill is quiet. Against SDPA itself: the keys filled True keep their weight, -inf ones none."""
    check_bug(tmp_path, "permutation_lm_float_hide_mask_masked_fill_true", "ones-added",
              Path(__file__).parent / "data" / "mhafloat")
    import torch

    torch.manual_seed(0)
    q = torch.randn(1, 1, 4, 8)
    hide = torch.ones(4, 4, dtype=torch.bool).triu(1)
    weights = [torch.nn.functional.scaled_dot_product_attention(q, q, torch.eye(4)[None, None],
                                                                attn_mask=torch.zeros(4, 4).masked_fill(hide, fill))
               for fill in (True, float("-inf"))]
    assert weights[0][0, 0][hide].min() > 0 and weights[1][0, 0][hide].max() == 0


def test_int_text_mask_joined_with_float_image_ones_added_to_eager_scores(tmp_path):
    """Written another way (tests/data/mhafloat; sd-scripts 2b07a92c's joint mask): an MM-DiT block with the image
    first, a left-padded prompt's int attention_mask joined after float ones and added to einsum scores by the program
    itself; the fix's (1 - mask) * finfo.min is quiet. Against softmax itself: a padded prompt key keeps weight under
    the 0/1 sum, none under the fix's."""
    [hit] = check_bug(tmp_path, "joint_dit_eager_int_text_mask_joined_float_added", "ones-added",
                      Path(__file__).parent / "data" / "mhafloat")
    assert "added to these scores" in hit["message"]
    import torch

    scores = torch.randn(2, 5)
    joint = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])  # (two image tokens, a prompt left-padded by two)
    assert torch.softmax(scores + joint, -1)[:, 2:4].min() > 0
    assert torch.softmax(scores + (1 - joint) * torch.finfo(torch.float32).min, -1)[:, 2:4].max() == 0


def test_qeff_gemma4_vision_padding_mask_added_as_zeros_and_ones(tmp_path):
    """quic/efficient-transformers#1159 (written blind, batch blind-mg; caught before any rule changed for it): the
    Gemma 4 vision tower's padding mask was built as 0/1 and added to the scores, so a smaller image's padding patches
    gained +1 instead of being masked. The fix adds 0 or the dtype's minimum."""
    hit = check_bug(tmp_path, "qeff_gemma4_vision_padding_mask_zero_one_added_as_bias", "ones-added")[0]
    assert "holds only 0 and 1" in " ".join(hit["message"].split())
