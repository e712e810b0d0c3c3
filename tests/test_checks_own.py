"""checks/own.py: what the attention states of itself (its module's causal flag, its sibling sliding layers, its own
first step), each rule caught in the published bug's reproduction (tests/data/bugs) and in a program written another
way (tests/data/own), quiet on both fixes; the flagged cell against a double loop over positions."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

OWN = Path(__file__).parent / "data" / "own"


def _cell(found: list[dict]) -> tuple:
    return tuple(found[0]["cell"])


def test_a_causal_flag_that_never_reached_the_softmax_is_found(tmp_path):
    found = check_bug(tmp_path, "xformers_causal_mask_skipped_without_att_mask", "causal-flag-ignored")
    assert _cell(found) == first((1, 16, 16), lambda b, q, k: k > q)  # unmasked: the first later key is flagged
    assert "ScaledDotProduct.causal" in found[0]["message"]


def test_an_is_causal_attribute_sdpa_is_not_told_is_found(tmp_path):
    found = check_bug(tmp_path, "flag_sdpa_gpt", "causal-flag-ignored", folder=OWN)
    assert _cell(found) == first((3, 7, 7), lambda b, q, k: k > q)
    assert "CausalSelfAttention.is_causal" in found[0]["message"]


def test_a_causal_flag_kept_by_an_attention_impl_object_that_never_built_the_mask_is_found(tmp_path):
    # vllm-omni#7324: FlashAttentionImpl (no nn.Module) holds causal=True; its dense path handed SDPA attn_mask=None
    found = check_bug(tmp_path, "vllm_omni_npu_dense_path_drops_causal", "causal-flag-ignored")
    assert _cell(found) == first((1, 10, 10), lambda b, q, k: k > q)
    assert "FlashAttentionImpl.causal" in found[0]["message"]


def test_an_is_causal_backend_dataclass_that_applies_only_key_padding_is_found(tmp_path):
    found = check_bug(tmp_path, "backend_object_causal_padded", "causal-flag-ignored", folder=OWN)
    lengths = (9, 6, 4)  # right-padded rows: only real queries and keys are judged
    assert _cell(found) == first((3, 9, 9), lambda b, q, k: k > q and q < lengths[b] and k < lengths[b])
    assert "EagerBackend.is_causal" in found[0]["message"]


def test_fewer_queries_than_keys_placed_last_that_see_a_later_key_are_found(tmp_path):
    """lucidrains/local-attention#5 (written blind): causal and exact_windowsize AND-ed, so each bucket's queries (the
    last 4 of its 8 look-back keys) see their own bucket's future. Written otherwise: a Transformer-XL style segment
    over 4 memory states whose causal mask waits for an argument never passed; both fixes quiet."""
    found = check_bug(tmp_path, "local_attention_exact_windowsize_drops_causal_mask", "causal-flag-ignored")
    assert "LocalAttention.causal" in found[0]["message"]
    # lucidrains/local-attention a4836b3 (written blind): bfloat16 bucket positions collide past 256, so some
    # queries see a later key of their bucket; its fix (long positions) quiet
    found = check_bug(tmp_path, "local_attention_half_precision_positions_break_causal_mask", "causal-flag-ignored")
    assert "LocalAttention.causal" in found[0]["message"]
    found = check_bug(tmp_path, "memory_segment_causal_flag", "causal-flag-ignored", folder=OWN)
    assert _cell(found) == first((1, 10, 10), lambda b, q, k: q >= 4 and k > q)  # queries at memory 4 + i


def test_a_flash_varlen_prompt_pass_run_not_causal_on_a_left_padded_batch_is_found(tmp_path):
    # huggingface/transformers#41966 (written blind): GPT-2's is_causal = attention_mask is None and q_len > 1, so a
    # left-padded batch's FlashAttention-2 prompt pass ran with causal=False although the module says is_causal
    found = check_bug(tmp_path, "gpt2_flash_attn_left_padding_not_causal", "causal-flag-ignored")
    assert "is_causal" in found[0]["message"]


def test_an_encoder_full_layer_run_causal_beside_symmetric_sliding_layers_is_found(tmp_path):
    found = check_bug(tmp_path, "t5gemma2_encoder_is_causal_flag", "full-narrower-than-sliding")
    sliding = lambda q, k: abs(q - k) < 4  # noqa: E731 - the sliding layer's mask (sliding_window=4 both ways)
    assert _cell(found) == first((2, 10, 10), lambda b, q, k: sliding(q, k) and not k <= q)
    assert found[0]["message"].startswith("layer 1 is a full layer (layer_types[1])")


def test_a_global_layer_built_causal_in_a_right_padded_local_global_encoder_is_found(tmp_path):
    found = check_bug(tmp_path, "full_causal_beside_band", "full-narrower-than-sliding", folder=OWN)
    real = lambda b, k: not (b == 1 and k >= 6)  # noqa: E731 - row 1 is padded from key 6
    assert _cell(found) == first((2, 9, 9), lambda b, q, k: real(b, q) and real(b, k) and abs(q - k) <= 2 and k > q)
    assert "self.cfg of Encoder (dict)" in found[0]["message"]


def test_a_draft_block_appended_one_zero_to_an_additive_mask_is_found(tmp_path):
    found = check_bug(tmp_path, "speculators_eagle3_dense_draft_mask_extension", "extension-leak")
    docs = [0, 0, 0, 0, 0, 1, 1, 1]
    base = lambda q, k: k <= q and docs[q] == docs[k]  # noqa: E731 - the first step's mask (causal, per document)
    b, q, k = first((1, 8, 8), lambda b, q, k: not base(q, k))  # the appended block sees every key
    assert _cell(found) == (b, q, 8 + k)


def test_an_all_true_draft_block_cat_to_a_bool_mask_is_found(tmp_path):
    found = check_bug(tmp_path, "draft_extension_bool", "extension-leak", folder=OWN)
    b, q, k = first((2, 6, 6), lambda b, q, k: k > q)
    assert _cell(found) == (b, q, 6 + k)


QUIET = Path(__file__).parent / "data" / "quiet"


def test_a_causal_flag_on_a_cross_attention_is_no_promise_about_its_memory(tmp_path):
    """A diffusers-style block builds attn1 and attn2 from one set of keywords, `causal=True` among them; the processor
    applies it only where no `encoder_hidden_states` is handed. attn2 attends to the whole prompt: quiet. The same
    program whose processor drops the flag everywhere is still found, on attn1 only (the first later key by a loop)."""
    from checkbugs import traced

    status, found, report = traced(tmp_path, "diffusers_attn2_causal_flag_self_only", False, QUIET)
    assert status == 0 and found == [], report
    source = (QUIET / "diffusers_attn2_causal_flag_self_only.py").read_text()
    dropped = source.replace("is_causal=attn.causal and is_self", "is_causal=False")
    assert dropped != source
    (tmp_path / "flag_dropped.py").write_text(dropped)
    status, found, report = traced(tmp_path, "flag_dropped", False, tmp_path)
    hits = [f for f in found if f["code"] == "causal-flag-ignored"]
    assert status == 1 and hits and all(".attn1" in f["message"] for f in hits), report
    assert tuple(hits[0]["cell"]) == first((2, 6, 6), lambda b, q, k: k > q)


def test_transformers_llama_sdpa_output_attentions_eager_fallback_no_causal_mask(tmp_path):
    """transformers#30652: Llama's SDPA attention falling back to eager for output_attentions drops the causal mask
    (written blind, batch blind-p; caught before any rule was changed for it)."""
    check_bug(tmp_path, "transformers_llama_sdpa_output_attentions_eager_fallback_no_causal_mask",
              "causal-flag-ignored")


def test_gpt_neox_causal_mask_value_too_small_to_mask(tmp_path):
    """EleutherAI/gpt-neox 102d09b8: MASK_VALUE = -1e-7 adds almost nothing, so the causal attention sees later keys
    (written blind, batch blind-s; caught before any rule was changed for it)."""
    check_bug(tmp_path, "gpt_neox_early_causal_mask_value_negligible", "causal-flag-ignored")


def test_a_forward_argument_use_causal_mask_that_never_reached_the_softmax(tmp_path):
    """keras#23038: MultiHeadAttention called with use_causal_mask=True leaves causality to the fused kernel, and the
    dropout path it then takes applies no mask (trace/forwardflag.py reads the forward argument); the fix builds it."""
    found = check_bug(tmp_path, "keras_mha_causal_only_fast_path_drops_mask_with_dropout", "causal-flag-ignored")
    assert _cell(found) == first((2, 7, 7), lambda b, q, k: k > q)
    assert "use_causal_mask=True" in found[0]["source"]


def test_is_causal_dropped_where_a_padding_mask_is_given(tmp_path):
    """Written another way: `is_causal=is_causal and key_padding_mask is None`, a right-padded batch (lengths 7, 5):
    the first real query that sees a later real key, by a double loop; the fix ANDs a causal triangle in: quiet."""
    found = check_bug(tmp_path, "is_causal_dropped_with_key_padding", "causal-flag-ignored", OWN)
    lengths = (7, 5)
    assert _cell(found) == first((2, 7, 7), lambda b, q, k: k > q and q < lengths[b] and k < lengths[b])
    assert found[0]["source"] == "SelfAttention.forward(is_causal=True)"


def test_a_fused_softmax_type_that_the_fallback_ignores_is_found(tmp_path):
    # NVIDIA/TransformerEngine#1524: SoftmaxType.SCALED_UPPER_TRIANG_MASKED run as a plain scaled softmax on fallback
    found = check_bug(tmp_path, "te_jax_softmax_fallback_drops_causal", "causal-flag-ignored")
    assert _cell(found) == first((2, 6, 6), lambda b, q, k: k > q)
    assert "Softmax.softmax_type=SCALED_UPPER_TRIANG_MASKED" in found[0]["message"]


def test_an_attn_mask_type_enum_that_sdpa_is_not_told_is_found(tmp_path):
    found = check_bug(tmp_path, "mask_type_causal_sdpa_unmasked", "causal-flag-ignored", folder=OWN)
    assert _cell(found) == first((3, 5, 5), lambda b, q, k: k > q)
    assert "CoreAttention.attn_mask_type=causal" in found[0]["message"]


def test_mask_types_read_as_causal_and_those_that_say_nothing():
    import enum

    from torch import nn

    from maskcli.trace.sites import causal_flag

    class Kind(enum.Enum):
        padding = 1
        padding_causal = 2
        no_mask = 3

    def said(**attributes):
        module = nn.Module()
        for name, value in attributes.items():
            setattr(module, name, value)
        return causal_flag([module])

    assert said(attn_mask_type="causal_bottom_right") == "Module.attn_mask_type=causal_bottom_right"
    assert said(mask_type=Kind.padding_causal) == "Module.mask_type=padding_causal"
    assert said(attn_mask_type=Kind.padding) is None and said(attn_mask_type="no_mask") is None
    assert said(attn_mask_type="arbitrary", softmax_type="scaled") is None
    assert said(attn_mask_type="non_causal") is None and said(mask_type="NotCausal") is None  # (the opposite word)
    assert said(is_causal=False, attn_mask_type="causal") == "Module.is_causal=False"  # (the flag speaks first)


def test_a_model_stated_causal_whose_encoder_got_no_mask_is_found(tmp_path):
    """speechbrain#2182 (written blind, batch blind-az): TransformerASR(causal=True) keeps `self.causal` but
    make_masks built no src_mask, so the encoder's self-attention saw later frames; the decoder's look-ahead mask and
    the cross-attention are left alone. The first later key a real query sees, by a double loop over the lengths."""
    found = check_bug(tmp_path, "speechbrain_transformer_asr_causal_encoder_without_src_mask", "causal-flag-ignored")
    assert all(f["message"].startswith("encoder.") for f in found)
    lengths = [24, 18]
    assert _cell(found) == first((2, 24, 24), lambda b, q, k: q < lengths[b] and q < k < lengths[b])
    assert "model states causal=True (TransformerASR.causal)" in found[0]["message"]


def test_a_causal_lm_on_an_encoder_stack_given_key_padding_only_is_found(tmp_path):
    """Written another way: a GPT-style model on nn.TransformerEncoder states `self.is_causal = True` and hands the
    stack only src_key_padding_mask (a right-padded batch); its fix passes the subsequent mask with is_causal=True."""
    found = check_bug(tmp_path, "causal_lm_encoder_stack_key_padding_only", "causal-flag-ignored", folder=OWN)
    lengths = [6, 4]
    assert _cell(found) == first((2, 6, 6), lambda b, q, k: q < lengths[b] and q < k < lengths[b])
    cells = sum(1 for n in lengths for q in range(n) for k in range(q + 1, n))
    assert f"({cells} such cells)" in found[0]["message"] and "TinyCausalLM.is_causal" in found[0]["message"]


def test_a_streaming_encoders_chunk_mask_never_returned_is_found_and_one_chunk_alone_is_quiet(tmp_path):
    # icefall 8ccd06105: Zipformer(causal=True)._get_attn_mask built the chunk mask and had no `return`; the scores are
    # (H, B, T, T) (trace/layouts.heads_first), the batch right-padded (40, 29); a streaming step of one chunk (8
    # frames, chunk_size=(8,)) masks nothing in both runs, as one chunk sees itself whole
    found = check_bug(tmp_path, "icefall_zipformer_streaming_chunk_attn_mask_never_returned", "causal-flag-ignored")
    lengths = (40, 29)
    assert _cell(found) == first((2, 40, 40), lambda b, q, k: k > q and q < lengths[b] and k < lengths[b])
    assert "(40, 40)" in found[0]["message"] and "Zipformer.causal" in found[0]["message"]
    assert len(found) == 1  # (not the one-chunk step)


def test_a_wenet_style_chunk_mask_built_then_the_padding_mask_handed_on_is_found(tmp_path):
    # the layers handed `masks` (padding alone) where `chunk_masks` was meant, over SDPA, right-padded (12, 9);
    # static_chunk_size=4: the one-chunk streaming step (4 frames) masks nothing and is quiet in both runs
    found = check_bug(tmp_path, "wenet_style_chunk_mask_computed_then_padding_passed", "causal-flag-ignored", folder=OWN)
    lengths = (12, 9)
    assert _cell(found) == first((2, 12, 12), lambda b, q, k: k > q and q < lengths[b] and k < lengths[b])
    assert "ConformerEncoder.causal" in found[0]["message"] and len(found) == 1


def test_reformer_lsh_chunks_whose_own_bucket_comes_first_are_not_read_as_queries_at_the_end(tmp_path):
    """lucidrains/reformer-pytorch 9222838 (written blind, batch blind-da): LSHAttention's chunks of 8 hash-sorted
    queries over [own bucket, the bucket looked back to]; its causal mask, by the sorted positions, is a staircase on the
    first keys. Read with the queries as the last keys, causal-flag-ignored called both the bug and its fix (contextual
    keys seen by every query) a flag that never reached the mask. A key hidden from one query and seen by a later one
    places no query after it: left alone, on both runs (the bug itself, contextual keys hidden by a clamped position,
    is not what this rule says)."""
    from checkbugs import traced

    blind = Path(__file__).parent / "data" / "blind"
    for fixed in (False, True):
        status, found, report = traced(tmp_path, "reformer_lsh_attention_causal_mask_hides_context_keys", fixed, blind)
        assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_regained_is_a_key_before_the_queries_hidden_then_seen_against_a_double_loop():
    import numpy as np

    from maskcli.checks.config import Placed
    from maskcli.checks.own import regained

    def reference(cells, own):
        rows = range(cells.shape[2])
        return any(not cells[b, 0, i, k] and cells[b, 0, j, k] for b in range(cells.shape[0]) for k in range(int(own.min()))
                   for i in rows for j in rows if j > i)

    lq, lk = 4, 8
    own, keys = np.arange(lk - lq, lk), np.arange(lk)
    real_q, real_k = np.ones((1, lq), bool), np.ones((1, lk), bool)
    masks = {
        "causal, queries last": keys[None, :] <= own[:, None],
        "a window of 3": (keys[None, :] <= own[:, None]) & (keys[None, :] > own[:, None] - 3),
        "a causal staircase on the first keys (the queries first)": keys[None, :] <= np.arange(lq)[:, None],
        "the first keys' staircase and the rest seen": (keys[None, :] <= np.arange(lq)[:, None]) | (keys[None, :] >= lq),
    }
    for name, mask in masks.items():
        cells = np.ascontiguousarray(mask[None, None])
        assert regained(Placed(cells, own, real_q, real_k)) == reference(cells, own), name
    assert not regained(Placed(np.ascontiguousarray(masks["a window of 3"][None, None]), own, real_q, real_k))
    assert regained(Placed(np.ascontiguousarray(masks["the first keys' staircase and the rest seen"][None, None]), own,
                           real_q, real_k))


def test_a_causal_flag_that_never_reached_the_tiles_of_a_blockwise_loop_is_found(tmp_path):
    """lucidrains/memory-efficient-attention-pytorch adf5751 (written blind): the chunked path never applied `causal`,
    so each (query chunk, key chunk) tile saw its later keys; each tile is placed at its chunks' starts (trace/tiled.py),
    so the fix's tiles after the diagonal (fully masked) and before it (masking nothing) are quiet. Written otherwise:
    a flash-style online softmax over left-padded rows that skips the later key blocks but leaves the diagonal ones
    unmasked; its fix (a triangle on the diagonal) quiet."""
    found = check_bug(tmp_path, "memory_efficient_attention_pytorch_chunked_key_mask_inverted_causal_dropped",
                      "causal-flag-ignored")
    assert "Attention.causal" in found[0]["message"]
    lengths = (11, 16)  # right-padded; no causal mask in any tile: any later real key of a real query
    b, q, k = _cell(found)
    assert k > q and q < lengths[b] and k < lengths[b]
    found = check_bug(tmp_path, "blockwise_causal_diagonal_tiles_unmasked", "causal-flag-ignored", folder=OWN)
    assert "BlockwiseSelfAttention.is_causal" in found[0]["message"]
    pads = (12 - 10, 0)  # left-padded (real queries and keys judged); only the diagonal 4 x 4 blocks see later keys
    assert _cell(found) == first((2, 12, 12), lambda b, q, k: k > q and q // 4 == k // 4 and min(q, k) >= pads[b])


def test_a_causal_mask_dropped_for_sdpa_then_read_by_the_eager_weights_path_is_found(tmp_path):
    # huggingface/transformers#30652 (written blind, batch blind-dq): LlamaModel._update_causal_mask dropped the mask
    # of an all-ones padding mask for SDPA's is_causal, but output_attentions=True fell back to eager attention, which
    # ran with no causal mask
    found = check_bug(tmp_path, "transformers_llama_sdpa_output_attentions_eager_fallback_drops_causal_mask",
                      "causal-flag-ignored")
    assert _cell(found) == first((2, 12, 12), lambda b, q, k: k > q)
    assert "LlamaSdpaAttention.is_causal" in found[0]["message"]
    # written another way: a NeoX-style float bias of None for an unpadded batch, read by the return_weights path
    found = check_bug(tmp_path, "need_weights_eager_path_drops_causal", "causal-flag-ignored", folder=OWN)
    assert _cell(found) == first((3, 10, 10), lambda b, q, k: k > q)
    assert "NeoXAttention.causal" in found[0]["message"]


def test_a_sliding_window_of_one_key_is_no_window_that_sees_both_ways():
    """Hunt 10: `maskcli model gemma3_text --window 1`: its sliding layers' masks are the diagonal, read as band(1),
    so full-narrower-than-sliding paired the causal full layer with a window that sees both ways, found no key it
    hides, and ended in "unexpected IndexError ... (a maskcli bug)"."""
    import pytest

    pytest.importorskip("transformers")
    from typer.testing import CliRunner

    from maskcli.commands import app

    result = CliRunner().invoke(app, ["model", "gemma3_text", "--window", "1", "--lengths", "3,2", "--new-tokens", "1"])
    assert result.exit_code in (0, 1) and "unexpected" not in result.output, result.output  # (1: its decode steps)
    assert "full-narrower-than-sliding" not in result.output
    assert "#0 window(1) (--lengths 3,2 --pad left)" in result.output, result.output


def test_a_helper_called_with_a_literal_causal_false_overrides_the_module_flag(tmp_path):
    # ChunkedSelfAttention states is_causal=True; its pass over the chunk before each chunk is `attend(..., causal=False)`
    # (all those keys lie before the queries): the program's word at the call, as a model call's is_causal=False is
    folder = Path(__file__).parent / "data" / "chunkmerge"
    status, found, report = traced(tmp_path, "unpadded_chunks_own_causal_previous_full_merged_by_lse", False, folder)
    assert status == 0 and "causal-flag-ignored" not in {f["code"] for f in found}, report
