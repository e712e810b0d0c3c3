"""checks/directions.py: attention run in another direction than the program states (causal-but-said-not,
decoder-mask-not-causal), and trace/builders.py's reading of a decoder's causal-mask builder."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, first, traced

DIRECTIONS = Path(__file__).parent / "data" / "directions"
BLIND = Path(__file__).parent / "data" / "blind"


def test_llm2vec_batch_of_one_runs_causal(tmp_path):
    """llm2vec#74: LlamaBiModel (is_causal=False) ran SDPA's is_causal on an unpadded batch of one, both ways on a
    padded batch of two."""
    hit = check_bug(tmp_path, "llm2vec_llama_bi_model_batch_one_sdpa_is_causal", "causal-but-said-not")[0]
    assert hit["expected"] == "bidirectional" and "ModifiedLlamaSdpaAttention.is_causal" in hit["source"]
    assert tuple(hit["cell"]) == first((1, 6, 6), lambda b, q, k: k > q)  # the first later key the causal pass misses


def test_a_bidirectional_flag_set_on_the_modules_only_is_found(tmp_path):
    # embeddings-benchmark/mteb#5469 (blind-au, caught before tuning): is_causal=False on the attention modules but not
    # on the config: a padded document batch gets create_causal_mask's causal mask, an unpadded one none (both ways)
    hit = check_bug(tmp_path, "mteb_colqwen_bidirectional_flag_only_on_modules", "causal-but-said-not")[0]
    assert hit["expected"] == "bidirectional" and "Qwen3_5Attention.is_causal" in hit["source"]
    assert tuple(hit["cell"]) == first((2, 10, 10), lambda b, q, k: k > q)  # the padded pass's first later key missed


def test_unpadded_fast_path_tril(tmp_path):
    """Written another way: `self.causal = False`, a masked softmax, a right-padded batch first, then an unpadded batch
    of two that takes a tril "fast path"; its fix is quiet."""
    status, found, report = traced(tmp_path, "encoder_unpadded_fast_path_tril", False, DIRECTIONS)
    assert status == 1, report
    hits = [f for f in found if f["code"] == "causal-but-said-not"]
    assert hits and all(f["severity"] == "wrong" for f in hits), report
    assert "SelfAttention.causal" in hits[0]["source"]
    assert tuple(hits[0]["cell"]) == first((2, 4, 4), lambda b, q, k: k > q)
    status, found, report = traced(tmp_path, "encoder_unpadded_fast_path_tril", True, DIRECTIONS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_opennmt_encoder_self_attention_handed_sdpas_is_causal(tmp_path):
    """OpenNMT-py#2464 (blind-ia, caught after tuning): every "self" attention, the encoder's (is_decoder=False)
    included, called SDPA with `is_causal=(mask is not None)` and no mask; the decoder's alone is causal after the fix."""
    status, found, report = traced(tmp_path, "opennmt_py_sdpa_self_path_makes_encoder_causal", False, BLIND)
    hits = [f for f in found if f["code"] == "causal-but-said-not"]
    assert status == 1 and [f["message"].split("'")[0] for f in hits] == [f"encoder.transformer.{i}.self_attn" for i in (0, 1)], report
    assert hits[0]["source"] == "MultiHeadedAttention.is_decoder=False" and hits[0]["expected"] == "bidirectional"
    assert tuple(hits[0]["cell"]) == first((32, 7, 7), lambda b, q, k: k > q)  # row 0 holds 7 real tokens
    status, found, report = traced(tmp_path, "opennmt_py_sdpa_self_path_makes_encoder_causal", True, BLIND)
    assert not [f for f in found if f["code"] == "causal-but-said-not"], report


def test_an_encoder_that_hands_is_causal_where_it_has_no_padding_mask(tmp_path):
    """Written another way: `self.causal = False`, `is_causal=attn_mask is None` and batches of equal length, so no
    call of the site attends both ways; the fix (is_causal=self.causal) is quiet."""
    status, found, report = traced(tmp_path, "encoder_sdpa_causal_without_padding_mask", False, DIRECTIONS)
    hits = [f for f in found if f["code"] == "causal-but-said-not"]
    assert status == 1 and len(hits) == 2 and all(f["severity"] == "wrong" for f in hits), report
    assert hits[0]["source"] == "EncoderAttention.causal=False" and "is_causal=True" in hits[0]["message"]
    assert tuple(hits[0]["cell"]) == first((3, 6, 6), lambda b, q, k: k > q)
    status, found, report = traced(tmp_path, "encoder_sdpa_causal_without_padding_mask", True, DIRECTIONS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_direction_chosen_per_call_is_quiet(tmp_path):
    """GritLM's way: the module's attribute says False, the model's forward is handed is_causal per call; its causal
    call is meant (trace records the forward's word beside the module's)."""
    status, found, report = traced(tmp_path, "per_call_direction_quiet", False, DIRECTIONS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_espnet2_decoder_without_subsequent_mask(tmp_path):
    """espnet#1539: ESPnet2's TransformerDecoder built tgt_mask from the target lengths alone; the module defines
    subsequent_mask() beside it."""
    hit = check_bug(tmp_path, "espnet2_transformer_decoder_no_subsequent_mask", "decoder-mask-not-causal")[0]
    assert "subsequent_mask()" in hit["source"]
    real = [[1] * 5, [1, 1, 1, 0, 0]]  # ys_in_lens (5, 3), right-padded
    assert tuple(hit["cell"]) == first((2, 5, 5), lambda b, q, k: k > q and bool(real[b][q] and real[b][k]))


def test_future_mask_on_the_incremental_path_only(tmp_path):
    """Written another way: buffered_future_mask as the decoder class's method, nn.MultiheadAttention with a
    key_padding_mask, right-padded targets; the mask applied only with an incremental state. Its fix is quiet."""
    status, found, report = traced(tmp_path, "seq2seq_future_mask_incremental_only", False, DIRECTIONS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "decoder-mask-not-causal")
    assert hit["severity"] == "wrong" and "buffered_future_mask()" in hit["source"]
    real = [[1, 1, 1, 1, 0, 0], [1] * 6]  # tokens equal to the padding id 0 end row 0
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: k > q and bool(real[b][q] and real[b][k]))
    status, found, report = traced(tmp_path, "seq2seq_future_mask_incremental_only", True, DIRECTIONS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_t5_decoder_self_attention_reading_the_encoders_direction(tmp_path):
    """TransformerLens#1681: one cfg (attention_dir="bidirectional") shared by the encoder and decoder T5Blocks, so the
    decoder's self-attention is never masked; the block says it is a decoder (self.is_decoder) and its attention class
    holds apply_causal_mask."""
    hit = check_bug(tmp_path, "transformerlens_t5_decoder_self_attention_shares_bidirectional_cfg",
                    "decoder-mask-not-causal")[0]
    assert "apply_causal_mask() beside T5Block (is_decoder=True)" in hit["source"]
    assert tuple(hit["cell"]) == first((2, 5, 5), lambda b, q, k: k > q)  # the targets are unpadded


def test_a_block_causal_only_while_training(tmp_path):
    """Written another way: blocks that say `self.is_decoder`, nn.MultiheadAttention with a key_padding_mask from the
    pad id over right-padded targets, make_causal_mask in the module's globals applied only while training; scored in
    eval mode. Its fix is quiet."""
    status, found, report = traced(tmp_path, "seq2seq_is_decoder_block_causal_only_in_training", False, DIRECTIONS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "decoder-mask-not-causal")
    assert hit["severity"] == "wrong" and "make_causal_mask() beside Block (is_decoder=True)" in hit["source"]
    real = [[1] * 5, [1, 1, 1, 0, 0]]  # tgt == PAD marks row 1's last two
    assert tuple(hit["cell"]) == first((2, 5, 5), lambda b, q, k: k > q and bool(real[b][q] and real[b][k]))
    status, found, report = traced(tmp_path, "seq2seq_is_decoder_block_causal_only_in_training", True, DIRECTIONS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_pytorch_translate_decoder_never_passes_self_attn_mask(tmp_path):
    """pytorch/translate#230 (written blind, batch blind-dh; caught before any rule was changed for it): after
    fairseq's refactor the decoder layer no longer masked the future itself, and pytorch_translate's decoder never
    passed self_attn_mask, so teacher-forced training attends to later targets; buffered_future_mask beside it."""
    hit = check_bug(tmp_path, "pytorch_translate_transformer_decoder_training_no_self_attn_mask",
                    "decoder-mask-not-causal")[0]
    assert "buffered_future_mask()" in hit["source"]
    assert tuple(hit["cell"]) == first((8, 7, 7), lambda b, q, k: k > q)  # the targets are unpadded


def test_pytorch_translate_decoder_without_self_attn_mask_written_blind_again(tmp_path):
    """pytorch/translate#230 (commit 398657f; written blind again, batch blind-ew, caught before any rule was changed
    for it): TransformerDecoder.forward calls each fairseq layer without self_attn_mask, so the full-sequence pass's
    targets see later targets; the program's buffered_future_mask names the causal mask it never passed."""
    hit = check_bug(tmp_path, "pytorch_translate_transformer_decoder_training_no_future_mask",
                    "decoder-mask-not-causal")[0]
    assert "buffered_future_mask()" in hit["source"]
    assert "query 0" in hit["message"] and "later key 1" in hit["message"]


def test_annotated_decoder_subsequent_mask_built_never_combined(tmp_path):
    """pytorch/translate#230's slip written as The Annotated Transformer writes a decoder: a module-level
    subsequent_mask beside it, the target mask the padding alone (right-padded targets), attention by hand; the first
    cell against a double loop over later real keys of real queries (row 0: 4 real targets)."""
    hit = check_bug(tmp_path, "annotated_decoder_subsequent_mask_built_never_combined", "decoder-mask-not-causal",
                    DIRECTIONS)[0]
    assert "subsequent_mask()" in hit["source"]
    real = [4, 6]
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: k > q and q < real[b] and k < real[b])


def test_a_decoder_wrapping_torchs_layers_never_hands_them_its_subsequent_mask(tmp_path):
    """Written another way: the program's own Seq2SeqDecoder around torch's nn.TransformerDecoder holds
    generate_square_subsequent_mask as a static method and hands the layers tgt_mask=None with the targets' key padding
    mask; the first row right-padded, a right-padded memory. Its fix is quiet."""
    name = "torch_decoder_wrapper_square_subsequent_mask_not_passed"
    status, found, report = traced(tmp_path, name, False, DIRECTIONS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "decoder-mask-not-causal")
    assert hit["severity"] == "wrong" and "generate_square_subsequent_mask() beside Seq2SeqDecoder" in hit["source"]
    real = [[1, 1, 1, 1, 0, 0], [1] * 6]  # prev_output_tokens == PAD ends row 0
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: k > q and bool(real[b][q] and real[b][k]))
    status, found, report = traced(tmp_path, name, True, DIRECTIONS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_nlp_tutorial_decoder_self_attention_handed_none(tmp_path):
    """graykode/nlp-tutorial 5b4fb5e (written blind, batch blind-dh): the decoder self-attention got None (teacher
    forcing sees later targets) though get_attn_subsequent_mask sits beside the Decoder; the softmax is an inline
    nn.Softmax() in a layer handed Q as its K (a self-attention), its cross-attention of as many keys told apart."""
    hit = check_bug(tmp_path, "nlp_tutorial_transformer_decoder_no_subsequent_mask_pad_id_not_zero",
                    "decoder-mask-not-causal")[0]
    assert "get_attn_subsequent_mask()" in hit["source"]
    assert tuple(hit["cell"]) == first((1, 5, 5), lambda b, q, k: k > q)


def test_a_decoder_handed_no_look_ahead_mask_at_an_inline_softmax(tmp_path):
    """Written another way (tests/data/directions): a TensorFlow-tutorial port, `MultiHeadAttention.forward(query, key,
    value, mask)` with torch.softmax inline, create_look_ahead_mask beside the Decoder never combined with the padding
    of right-padded targets. Its fix is quiet."""
    status, found, report = traced(tmp_path, "tf_port_decoder_look_ahead_mask_never_combined", False, DIRECTIONS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "decoder-mask-not-causal")
    assert hit["severity"] == "wrong" and "create_look_ahead_mask()" in hit["source"]
    real = [[1] * 6, [1, 1, 1, 1, 0, 0]]  # tar == 0 ends row 1
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: k > q and bool(real[b][q] and real[b][k]))
    status, found, report = traced(tmp_path, "tf_port_decoder_look_ahead_mask_never_combined", True, DIRECTIONS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def subsequent_mask(n):  # a builder in this file's globals: the decoder classes below are the program's own
    return torch.ones(n, n, dtype=torch.bool).tril()


class TransformerDecoder(torch.nn.Module):
    def forward(self, x):
        return x


class MLMDecoder(torch.nn.Module):  # Mask-CTC's non-autoregressive decoder: both ways on purpose
    def forward(self, x):
        return x


class DecoderLayer(torch.nn.Module):  # a layer with no builder of its own in a class: the module's globals hold one
    def forward(self, x):
        return x


class Encoder(torch.nn.Module):
    def forward(self, x):
        return x


class EncoderDecoder(torch.nn.Module):  # the Annotated Transformer's whole model: speaks for neither part
    def forward(self, x):
        return x


class Attention(torch.nn.Module):
    def forward(self, x):
        return x


class CausalCapable(torch.nn.Module):  # TransformerLens' attention: a method that applies the causal mask
    def apply_causal_mask(self, scores):
        return scores

    def forward(self, x):
        return x


class Block(torch.nn.Module):  # T5's block: says which side it is, no word "decoder" in its class
    def __init__(self, is_decoder):
        super().__init__()
        self.is_decoder = is_decoder

    def forward(self, x):
        return x


def test_builder_reading():
    """causal_builder: the innermost decoder class of the program's own whose module or class holds a builder; none for
    a library's decoder (torch's, which DETR runs without a causal mask), a decoder that names itself
    non-autoregressive, an encoder (even inside a whole EncoderDecoder), or no decoder."""
    from maskcli.trace.builders import causal_builder

    assert causal_builder([TransformerDecoder(), DecoderLayer()]).startswith("subsequent_mask() beside DecoderLayer")
    assert causal_builder([TransformerDecoder(), Attention()]).startswith("subsequent_mask() beside TransformerDecoder")
    assert causal_builder([EncoderDecoder(), Encoder(), Attention()]) is None  # the encoder's self-attention
    assert causal_builder([EncoderDecoder(), TransformerDecoder(), Attention()]).startswith("subsequent_mask() beside "
                                                                                         "TransformerDecoder")
    assert causal_builder([TransformerDecoder(), MLMDecoder()]) is None
    assert causal_builder([Encoder()]) is None
    # a block that says it is a decoder: the builder its class's module holds, or the attention's class inside it
    assert causal_builder([Block(True), Attention()]).startswith("subsequent_mask() beside Block (is_decoder=True)")
    assert causal_builder([Block(True), CausalCapable()]).startswith("subsequent_mask() beside Block")
    assert causal_builder([Block(False), CausalCapable()]) is None  # an encoder's block
    assert causal_builder([Attention(), Block(False), CausalCapable()]) is None
    layer = torch.nn.TransformerDecoderLayer(8, 2)
    assert causal_builder([torch.nn.TransformerDecoder(layer, 1), layer]) is None


def test_gritlm_embedding_pass_handed_is_causal_false_is_quiet(tmp_path):
    """ContextualAI/gritlm (quiet-zm, written blind): one Mistral model whose decoder builds causal masks embeds with
    `model(**inputs, is_causal=False)` (a padding mask alone: the caller's word against the forward's default True) and
    generates causal; after the embedding call the program zeroes the instruction tokens of the attention_mask it
    handed, for its pooling. Neither decoder-mask-not-causal nor padding-ignored (read as handed: trace/outer.py)."""
    blind = Path(__file__).parent / "data" / "quiet_blind"
    status, found, report = traced(tmp_path, "quiet_gritlm_unified_bidirectional_embed_causal_gen", False, blind)
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert status == 0, report


def test_pno_ai_causal_mask_applied_only_when_the_caller_hands_one(tmp_path):
    # chathasphere/pno-ai 316faa3 (written blind, batch blind-ez; caught before any rule was changed for it):
    # MultiheadedAttention masked only with the caller's mask; generate.sample() calls model(input_tensor) with none,
    # so the decoder whose module holds subsequent_mask() attends both ways while sampling
    found = check_bug(tmp_path, "pno_ai_attention_causal_mask_only_from_caller", "decoder-mask-not-causal")
    assert tuple(found[0]["cell"]) == first((4, 6, 6), lambda b, q, k: k > q)  # 1 prompt x 4 heads (bmm), 6 tokens
    assert "subsequent_mask() beside DecoderLayer" in found[0]["message"] and "(60 such cells)" in found[0]["message"]


def test_an_sdpa_decoder_that_masks_only_with_the_training_mask_samples_both_ways(tmp_path):
    # the same bug written another way: SDPA blocks with attn_mask=None by default, the causal & padding mask built by
    # the training code only, a dataclass config; the sampler calls model(ids)
    found = check_bug(tmp_path, "sdpa_decoder_causal_only_from_training_mask", "decoder-mask-not-causal",
                      folder=DIRECTIONS)
    assert tuple(found[0]["cell"]) == first((1, 4, 4), lambda b, q, k: k > q)  # the 4-token prompt, first step
    assert "generate_square_subsequent_mask() beside DecoderBlock" in found[0]["message"]
    status, findings, report = traced(tmp_path, "sdpa_decoder_causal_only_from_training_mask", True, DIRECTIONS)
    assert [f for f in findings if f["severity"] in ("wrong", "suspicious")] == [], report


def test_padded_queries_of_scores_folded_with_the_heads_are_padding(tmp_path):
    """transformers#9601's fix (TF LED, blind-kw: decoder-sees-later on it before): eager scores laid (bsz * heads,
    tgt, src) over a left-padded decoder prefix, the causal and padding biases summed, so a pad query's row is lowered
    everywhere and sees later keys. Its module states 4 heads and its layer 2 rows: the model call's attention_mask,
    laid batch-major over the 8 rows, calls those queries padding (checks/realfold.py). Written another way: a
    hand-written BART-style decoder: quiet."""
    from pathlib import Path

    from checkbugs import traced

    status, found, report = traced(tmp_path, "folded_heads_left_padded_decoder_additive_quiet", False,
                                   Path(__file__).parent / "data" / "directions")
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_the_batch_is_laid_on_the_folded_rows_batch_major():
    from types import SimpleNamespace

    import numpy as np

    from maskcli.checks.realfold import folded

    mask = np.array([[1, 1, 1], [0, 1, 1]], dtype=bool)
    call = SimpleNamespace(shape=(6, 1, 3, 3), details={"stated_heads": 3, "query_input": (2, 3)})
    said = folded(call, None, 6, 3, lambda top, rows, length: (mask, "attention_mask", True) if rows == 2 else None)
    assert [list(row) for row in said[0]] == [list(mask[n // 3]) for n in range(6)] and said[1:] == ("attention_mask", True)
    call.details["stated_heads"] = 2
    assert folded(call, None, 6, 3, lambda *a: (mask, "m", True)) is None


def test_paligemma_text_queries_run_causal_padded_and_both_ways_alone(tmp_path):
    """ColPali's fix (written blind, batch blind-ls) run on transformers 5: PaliGemmaConfig sets its text config's
    `use_bidirectional_attention=True`, so its attention modules say is_causal=False, yet PaliGemmaModel hands a padded
    batch of text queries (no token_type_ids) a 4-D causal mask, while the same query alone gets no mask and SDPA runs
    it both ways. The program itself measures the two apart (its own reference: the query run alone); the checks say
    the contradiction of the library's own statements (tests/data/directions)."""
    status, found, report = traced(tmp_path, "paligemma_text_only_queries_and_image_documents", False, DIRECTIONS)
    assert status == 1, report
    said = [f for f in found if f["code"] == "causal-but-said-not"]
    assert len(said) == 2 and all("a causal mask on this batch shape only" in f["message"] for f in said), report
    gaps = [float(line.rsplit(" ", 1)[1]) for line in report.splitlines() if "padded in the batch vs alone" in line]
    assert len(gaps) == 2 and min(gaps) > 0.1, report  # (the two readings of one query differ, as the finding says)


def test_tfts_informer_decoder_handed_no_mask_beside_a_causal_mask_class(tmp_path):
    """LongxingTan/Time-series-prediction#33 (1e3651a; written blind, blind-ni, missed before tuning): Informer's
    decoder self-attention was called with x_mask=None, though the module defines `CausalMask` (a class, as a
    TensorFlow port writes a builder: trace/builders.py reads its CamelCase name). Every forecast step sees the later
    ones. The project's fix multiplies the scores by that 0/1 mask (`score * mask`), which hides nothing: both findings
    on it are true (ones-multiplied, and the decoder still sees later steps), so it is checked finding by finding."""
    name = "tfts_informer_decoder_self_attention_no_causal_mask"
    status, found, report = traced(tmp_path, name, False, BLIND)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "decoder-mask-not-causal")
    assert hit["severity"] == "wrong" and "CausalMask() beside DecoderLayer" in hit["source"], report
    assert tuple(hit["cell"]) == first((2, 7, 7), lambda b, q, k: k > q)
    assert "decoder.layers.0.attn1" in hit["message"] and "attn2" not in hit["message"]
    status, found, report = traced(tmp_path, name, True, BLIND)
    assert {f["code"] for f in found if f["severity"] == "wrong"} == {"decoder-mask-not-causal", "ones-multiplied"}, \
        report


def test_a_lookahead_mask_class_beside_the_decoder_never_handed_to_it(tmp_path):
    """Written another way than tfts#33: an encoder-decoder of the program's own, `LookAheadMask(T).mask` a class at
    module level, the decoder's self-attention handed mask=None (masked_fill only where a mask is given). The fix
    (the class's mask handed to each decoder layer) is quiet."""
    hit = check_bug(tmp_path, "decoder_lookahead_mask_class_never_passed", "decoder-mask-not-causal", DIRECTIONS)[0]
    assert "LookAheadMask() beside" in hit["source"] and "self_attn" in hit["message"]
    assert tuple(hit["cell"]) == first((2, 5, 5), lambda b, q, k: k > q)


def test_torchelie_non_causal_layer_called_once_with_is_causal(tmp_path):
    """Vermeille/Torchelie 866bda6 (written blind, batch blind-oh; missed before, each block's SelfAttention called
    once a forward): `is_causal=kv_cache is None or self.causal` is True without a cache, so an encoder block built
    with causal=False ran causal. The module's own word against the flag it hands its kernel stands for a site of one
    call too. Fix (`kv_cache is not None or self.causal`) quiet."""
    found = check_bug(tmp_path, "torchelie_selfattention_noncausal_layer_runs_causal", "causal-but-said-not", BLIND)
    assert found[0]["message"].startswith("blocks.0.attn's module states causal=False (SelfAttention.causal), yet its "
                                          "sdpa is called causal (is_causal=True)")
    assert tuple(found[0]["cell"]) == first((2, 7, 7), lambda b, q, k: k > q)  # every later key: query 0 misses key 1


def test_an_encoder_layer_called_once_that_hands_is_causal_without_a_mask_is_found():
    """The same slip written another way: a layer with `self.is_causal = False` whose forward takes SDPA's shortcut
    `is_causal=mask is None` (no padding mask, run causal), one call per layer; handing is_causal=self.is_causal
    instead is quiet."""
    import torch.nn.functional as F
    from torch import nn

    import maskcli

    class Layer(nn.Module):
        def __init__(self, slip: bool):
            super().__init__()
            self.is_causal, self.slip = False, slip

        def forward(self, x, mask=None):
            flag = mask is None if self.slip else self.is_causal
            return F.scaled_dot_product_attention(x, x, x, attn_mask=mask, is_causal=flag)

    x = torch.randn(2, 2, 5, 4)
    for slip in (True, False):
        with torch.no_grad(), maskcli.trace() as t:
            Layer(slip)(x)
        codes = [f.code for g in t.groups() for f in g.findings]
        assert ("causal-but-said-not" in codes) is slip, codes


def test_qeff_gemma4_rebuilds_the_vision_block_mask_for_a_causal_config(tmp_path):
    """quic/efficient-transformers#1159 (written blind, blind-pr, caught before tuning): QEfficient's Gemma 4 attention
    rebuilt the image-block bidirectional mask on every prefill with mm_token_type_ids, though E2B's config leaves
    `use_bidirectional_attention` unset (causal); the fix gates it on `== "vision"`."""
    hit = check_bug(tmp_path, "qeff_gemma4_e2b_prefill_attention_rebuilds_vision_block_mask_ungated",
                    "decoder-mask-not-causal")[0]
    assert hit["severity"] == "wrong"
