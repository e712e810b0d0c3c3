"""checks/decoders.py: a config that says is_decoder=True, or states its attention causal, whose self-attention sees
later real keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkbugs import check_bug, first, traced

HELD = Path(__file__).parent / "data" / "held"
ROWS = Path(__file__).parent / "data" / "rows"


def test_roformer_causal_lm_bidirectional(tmp_path):
    """transformers#48745: RoFormerForCausalLM (config.is_decoder=True) built a bidirectional mask."""
    check_bug(tmp_path, "roformer_causal_lm_decoder_bidirectional_mask", "decoder-sees-later")


def test_dict_config_decoder_padding_only(tmp_path):
    """Written another way: a dict config held as self.cfg, a left-padded batch; the first cell is a double loop's over
    real queries and later real keys."""
    status, found, report = traced(tmp_path, "dict_config_decoder_padding_only", False, HELD)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "decoder-sees-later")
    assert hit["severity"] == "wrong" and "self.cfg of LM (dict)" in hit["source"]
    real = [[0, 0, 1, 1, 1], [1] * 5]
    assert tuple(hit["cell"]) == first((2, 5, 5), lambda b, q, k: k > q and bool(real[b][q] and real[b][k]))
    status, found, report = traced(tmp_path, "dict_config_decoder_padding_only", True, HELD)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_encoder_decoder_and_encoders_left_alone():
    """fields_of: is_decoder=True alone says a causal decoder; an encoder-decoder's whole config or is_decoder=False
    does not; a config with neither states nothing."""
    from maskcli.checks.intent import fields_of

    assert fields_of({"is_decoder": True})["causal_decoder"] is True
    assert fields_of({"is_decoder": True, "is_encoder_decoder": True}) == {}
    assert fields_of({"is_decoder": False, "hidden": 4}) == {}
    assert fields_of({"is_decoder": False, "sliding_window": 4})["causal_decoder"] is False


def test_mnn_decoder_embedding_exported_on_the_bidirectional_path(tmp_path):
    """alibaba/MNN#4548 (written blind, batch blind-cb): every embedding export took the bidirectional "int" mask path,
    so a Qwen3-Embedding style decoder (its module's own `self.is_decoder = True`) ran both ways at runtime. Said by
    the module's own attribute (trace/owndecoder.py); the first cell is a loop's over later keys (one unpadded row)."""
    hit = check_bug(tmp_path, "mnn_decoder_embedding_export_bidirectional_mask", "decoder-sees-later")[0]
    assert tuple(hit["cell"]) == first((1, 12, 12), lambda b, q, k: k > q)
    assert hit["source"] == "is_decoder=True (self.is_decoder=True of Embedding)"


def test_nntile_t5_generate_leaves_the_decoder_mask_out(tmp_path):
    """nntile/nntile#377 (written blind, batch blind-cb): the T5 greedy loop re-ran the decoder with no
    decoder_attention_mask, so its self-attention saw the whole generated prefix both ways; the decoder blocks say
    `self.is_decoder = True` (the encoder's False speak for theirs)."""
    found = check_bug(tmp_path, "nntile_t5_generate_decoder_without_causal_mask", "decoder-sees-later")
    assert all(f["source"].startswith("is_decoder=True (self.is_decoder=True of decoder.") for f in found)
    assert tuple(found[0]["cell"]) == first((1, 2, 2), lambda b, q, k: k > q)


def test_bert_lm_head_layers_that_say_is_decoder(tmp_path):
    """Written another way: BERT-style layers each keeping `self.is_decoder = True`, a float additive mask built from a
    right-padded batch's padding alone, handed to SDPA; the first cell is a double loop's over real queries and later
    real keys. The fix (the triangle and-ed in where is_decoder) is quiet."""
    folder = Path(__file__).parent / "data" / "owndecoder"
    status, found, report = traced(tmp_path, "bert_lm_head_layers_is_decoder_padding_only_mask", False, folder)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "decoder-sees-later")
    assert hit["severity"] == "wrong" and "self.is_decoder=True of layer." in hit["source"]
    real = [[1] * 6, [1, 1, 1, 0, 0, 0]]
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: k > q and bool(real[b][q] and real[b][k]))
    status, found, report = traced(tmp_path, "bert_lm_head_layers_is_decoder_padding_only_mask", True, folder)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_decoders_text_config_held_by_no_module_is_not_its_encoders(tmp_path):
    """Pix2Struct's recipe (quiet_blind round 60: its vision encoder was told decoder-sees-later) written another way: a
    `BertConfig(is_decoder=True)` at the top of the program, held by no module, beside a BertModel encoder built from a
    config of its own (no is_decoder), run bidirectionally over a padded batch (the program checks each row against
    itself alone). The model call's own config says it is no decoder: the program's other config is not its."""
    pytest.importorskip("transformers")
    status, found, report = traced(tmp_path, "text_decoder_config_beside_a_bidirectional_encoder_quiet", False, HELD)
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert status == 0, report


def test_gemma4_audio_context_right_zero_inverted_blocks(tmp_path):
    """transformers#48818 (written blind): Gemma 4's audio encoder read its blocked local mask the wrong way round, so
    frames saw later frames of their context; its config states `attention_context_right=0` (no frame past its own)."""
    flagged = check_bug(tmp_path, "gemma4_audio_blocked_local_attention_eager_mask_inverted", "decoder-sees-later")
    assert "attention_context_right=0" in flagged[0]["source"]


def test_dataclass_causal_config_mask_one_diagonal_ahead(tmp_path):
    """Written another way: a dataclass config held as self.cfg states `causal=True`; the mask is tril(diagonal=1) over
    a right-padded batch. The first cell is a double loop's over real queries and the later real keys tril(1) keeps."""
    status, found, report = traced(tmp_path, "dataclass_causal_config_mask_diagonal_one_ahead", False, ROWS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "decoder-sees-later")
    assert hit["severity"] == "wrong" and hit["source"].startswith("causal=True (self.cfg")
    lengths = [6, 4]
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: k == q + 1 and k < lengths[b])
    status, found, report = traced(tmp_path, "dataclass_causal_config_mask_diagonal_one_ahead", True, ROWS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_chunk_causal_reads_chunks_that_see_themselves_whole():
    """chunk_causal: later keys each in the query's own chunk (a streaming encoder's chunk mask, 12 frames of 4) are
    chunks; a query one key ahead (tril(diagonal=1)) or an inverted mask is not."""
    import numpy as np

    from maskcli.checks.decoders import chunk_causal

    own = np.arange(12)
    def later(keep):  # (1, Lq, Lk) bool of the later keys a double loop keeps
        return np.array([[[keep(q, k) and k > q for k in range(12)] for q in range(12)]])
    assert chunk_causal(later(lambda q, k: k // 4 <= q // 4), own)
    assert not chunk_causal(later(lambda q, k: k <= q + 1), own)
    assert not chunk_causal(later(lambda q, k: k >= q), own)


def test_bert_summarizer_decoder_without_its_tgt_mask(tmp_path):
    """k-tahiro/bert-summarizer#36 (written blind, batch blind-ma; caught before any rule was changed for it): BertSumAbs
    handed its nn.TransformerDecoder the summary's and the source's padding masks but no causal `tgt_mask`, so each
    summary token saw the later ones; its config says `is_decoder=True`. The fix passes the upper-triangular mask."""
    found = check_bug(tmp_path, "bert_summarizer_bertsumabs_decoder_no_tgt_mask", "decoder-sees-later")
    assert "query 0 sees the later key 1" in " ".join(found[0]["message"].split())


def test_a_pass_its_module_is_handed_is_causal_false_is_the_callers_word_over_an_is_decoder_config(tmp_path):
    """e-c-k-e-r/vall-e 90b3509 (written blind, blind-zr; decoder-sees-later on the buggy run and on its fix before):
    the AR/NAR model's config says is_decoder=True and causal=True, and its NAR passes hand each attention
    `is_causal=False` (the batch split by each row's causality): those passes attend both ways by the caller's own
    word. Neither run is said to see ahead now (the bug itself, row 0's segment mask built from row 1's lengths, is
    not caught)."""
    from pathlib import Path

    for fixed in (False, True):
        status, found, report = traced(tmp_path, "valle_ecker_nar_len_segmented_mask_aux_lens_aliased_rows", fixed,
                                       Path(__file__).parent / "data" / "blind")
        assert not [f for f in found if f["code"] == "decoder-sees-later"], report
