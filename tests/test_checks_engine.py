"""checks/engine.py: the rules over programs maskcli did not write, as their projects write them: PyTorch's
nn.Transformer family, nanoGPT's attention, a tiny Hugging Face decoder generating from a left-padded batch. A
correct program gets no wrong or suspicious finding (the full sweep over every family: benchmarks/false_alarms.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from checkbugs import imports_transformers
from maskcli.commands import app

runner = CliRunner()

PROGRAMS = {
    # torch/nn/modules/transformer.py: the encoder takes its nested-tensor fast path with a key padding mask
    "encoder_padding": """
        import torch, torch.nn as nn
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
        encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval()
        padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
        with torch.no_grad():
            encoder(torch.randn(2, 5, 8), src_key_padding_mask=padding)
    """,
    # nn.Transformer: a causal target, the source's padding on the encoder and on the cross-attention's memory
    "transformer_seq2seq": """
        import torch, torch.nn as nn
        torch.manual_seed(0)
        model = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16,
                               batch_first=True).eval()
        src_padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(4)
        with torch.no_grad():
            model(torch.randn(2, 6, 8), torch.randn(2, 4, 8), tgt_mask=tgt_mask, src_key_padding_mask=src_padding,
                  memory_key_padding_mask=src_padding, tgt_is_causal=True)
    """,
    # nanoGPT's CausalSelfAttention, both paths (model.py: flash with is_causal=True, else the bias buffer)
    "nanogpt": """
        import math, torch, torch.nn as nn, torch.nn.functional as F
        class CausalSelfAttention(nn.Module):
            def __init__(self, n_embd=8, n_head=2, block_size=8, flash=True):
                super().__init__()
                self.c_attn = nn.Linear(n_embd, 3 * n_embd)
                self.n_head, self.n_embd, self.flash = n_head, n_embd, flash
                self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))
            def forward(self, x):
                B, T, C = x.size()
                q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
                k, q, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (k, q, v))
                if self.flash:
                    y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0, is_causal=True)
                else:
                    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
                    att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
                    y = F.softmax(att, dim=-1) @ v
                return y.transpose(1, 2).contiguous().view(B, T, C)
        torch.manual_seed(0)
        x = torch.randn(2, 6, 8)
        with torch.no_grad():
            CausalSelfAttention(flash=True)(x)
            CausalSelfAttention(flash=False)(x)
    """,
    # one nn.TransformerEncoder called bidirectional with a key padding mask and causal with mask= and is_causal=True,
    # in train and in eval (its fast path): each call is a pass of its own, not a decode step that lost its mask
    "encoder_both_ways": """
        import torch, torch.nn as nn
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
        encoder = nn.TransformerEncoder(layer, num_layers=2)
        x = torch.randn(3, 6, 8)
        padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False] * 2 + [True] * 4])
        causal = nn.Transformer.generate_square_subsequent_mask(6)
        for train in (True, False):
            encoder.train(train)
            with torch.set_grad_enabled(train):
                encoder(x, src_key_padding_mask=padding)
                encoder(x, mask=causal, is_causal=True)
    """,
    # nn.MultiheadAttention as its docs call it: need_weights both ways, a key padding mask, then a causal attn_mask
    "mha_need_weights": """
        import torch, torch.nn as nn
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(8, 2, batch_first=True)
        x = torch.randn(2, 5, 8)
        padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
        causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
        for need_weights in (True, False):
            mha(x, x, x, key_padding_mask=padding, need_weights=need_weights)
            mha(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)
    """,
    # a decoder longer than its encoder's memory (more queries than keys): the cross-attention sees every memory key
    # (its padding cut), which no bottom-right placement of its queries reads right
    "decoder_longer_than_memory": """
        import torch, torch.nn as nn
        torch.manual_seed(0)
        layer = nn.TransformerDecoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True, dropout=0.0)
        decoder = nn.TransformerDecoder(layer, num_layers=2).eval()
        memory_padding = torch.tensor([[False, False, True], [False, False, False]])
        with torch.no_grad():
            decoder(torch.randn(2, 7, 8), torch.randn(2, 3, 8), tgt_mask=nn.Transformer.generate_square_subsequent_mask(7),
                    tgt_is_causal=True)
            decoder(torch.randn(2, 7, 8), torch.randn(2, 3, 8), tgt_mask=nn.Transformer.generate_square_subsequent_mask(7),
                    memory_key_padding_mask=memory_padding)
    """,
    # cross-attention written by hand (a Perceiver / Flamingo style module): queries of one sequence, keys and values
    # projected from another, shorter one, with an explicit all-ones mask
    "hand_written_cross_attention": """
        import torch, torch.nn as nn, torch.nn.functional as F
        class Resampler(nn.Module):
            def __init__(self):
                super().__init__()
                self.q, self.kv = nn.Linear(8, 8), nn.Linear(8, 16)
            def forward(self, x, context):
                q = self.q(x).view(1, 6, 2, 4).transpose(1, 2)
                k, v = self.kv(context).view(1, 3, 2, 8).transpose(1, 2).chunk(2, dim=-1)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(6, 3, dtype=torch.bool))
        with torch.no_grad():
            Resampler()(torch.randn(1, 6, 8), torch.randn(1, 3, 8))
    """,
    # Gemma 3's masks written by hand (masking_utils' sliding overlay: a window back, every later key kept), with an
    # image of 6 tokens under a window of 3 and no token_type_ids to read: the image's first token sees its last
    "gemma3_like_long_image": """
        import torch, torch.nn.functional as F
        torch.manual_seed(0)
        image = torch.tensor([-1, -1, 0, 0, 0, 0, 0, 0, -1, -1])
        q_idx, k_idx = torch.arange(10)[:, None], torch.arange(10)[None, :]
        full = (k_idx <= q_idx) | ((image[:, None] == image[None, :]) & (image[:, None] >= 0))
        sliding = full & (q_idx - k_idx < 3)
        x = torch.randn(1, 2, 10, 8)
        for mask in (sliding, full, sliding, full):
            F.scaled_dot_product_attention(x, x, x, attn_mask=mask)
    """,
}


def _alarms(tmp_path, name: str, source: str) -> tuple[int, list, str]:
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(source))
    out = tmp_path / f"{name}.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
    data = json.loads(out.read_text())
    assert data["exit_status"] == 0 and data["calls"], result.output
    alarms = [f for g in data["groups"] for f in g["findings"] if f["severity"] in ("wrong", "suspicious")]
    return result.exit_code, alarms, result.output


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_no_alarm_on_correct_pytorch_programs(tmp_path, name):
    status, alarms, report = _alarms(tmp_path, name, PROGRAMS[name])
    assert (status, alarms) == (0, []), report


QUIET = [  # tests/data/quiet: correct programs of the kinds a rule could misread, written as their projects write them
    "speech_decoder_cross_lengths",  # a decoder longer than its memory, the memory's lengths as a key padding mask
    "seq2seq_both_sides_padded",  # nn.Transformer, both sides padded, one length
    "bart_like_attention_mask_both_sides",  # attention_mask the source's, decoder_attention_mask the target's
    "qformer_queries_and_text",  # learned queries as many as the patches, cross and joint self-attention
    "left_padded_generate_sliding_window",  # a window over a left-padded batch with a cache, three steps
    "static_cache_prefill_gpt_fast",  # gpt-fast: queries at input_pos over every slot
    "static_cache_left_padded_cache_position",  # a static cache, left padding, cache_position
    "packed_documents_position_ids",  # position_ids restarting, the mask rebuilt from them
    "longformer_global_local",  # a symmetric band, a global token, padding
    "beam_search_cache_reorder",  # the cache reordered by beam each step
    "beam_search_left_padded_reorder",  # the same over a left-padded batch, the mask reordered with it
    "engine_request_lengths_padded_window_verify",  # per-request metadata: masked block slots, a rolling window, verify
    "keras_port_seq2seq_use_causal_mask",  # use_causal_mask per call, Keras padding masks (True = a token)
    "causal_self_attention_sliding_cache_forecast",  # a class named causal, float features, a sliding cache, kept causal
    "prompt_loss_mask_beside_causal_ids",  # a plain `mask` that is a prompt loss mask (0s leading each row, varied ids)
    "grouped_bias_five_axes_padded",  # an additive (batch, 1, 1, q, k) bias kept by einsum scores and by SDPA
    "causal_cross_attention_class_perceiver_ar",  # a `CausalCrossAttention` triangle, meant; a `CrossAttention` unmasked
    "summary_token_appended_beside_lengths",  # `lengths` of the input's tokens, a summary key appended after them
]


@pytest.mark.parametrize("name", QUIET)
def test_no_alarm_on_correct_programs_written_as_their_projects_write_them(tmp_path, name):
    from pathlib import Path

    from checkbugs import traced

    status, found, report = traced(tmp_path, name, False, Path(__file__).parent / "data" / "quiet")
    assert (status, [f for f in found if f["severity"] in ("wrong", "suspicious")]) == (0, []), report


def test_no_alarm_on_a_hugging_face_decoder_generating_from_a_left_padded_batch(tmp_path):
    """Llama and Mistral (a sliding window) with a dynamic and a static cache (transformers' generate: the static
    cache's queries at its start, cache_position placing them)."""
    pytest.importorskip("transformers")
    source = """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
        torch.manual_seed(0)
        for cls, cfg, extra in ((LlamaForCausalLM, LlamaConfig, {}), (MistralForCausalLM, MistralConfig, {"sliding_window": 3})):
            config = cfg(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, pad_token_id=0, **extra)
            model = cls(config).eval()
            ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
            for cache in ("static", "dynamic"):
                model.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=3, do_sample=False,
                               cache_implementation=cache, pad_token_id=0)
    """
    status, alarms, report = _alarms(tmp_path, "hf_generate", source)
    assert (status, alarms) == (0, []), report


def test_no_alarm_on_encoder_decoders_whose_target_is_longer_than_their_source(tmp_path):
    """BART and T5 built from their configs, a padded 4-token source and a 9-token target, in one forward pass and
    under generate: the cross-attention (encoder_attn, EncDecAttention) has more queries than keys."""
    pytest.importorskip("transformers")
    source = """
        import torch
        from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration
        torch.manual_seed(0)
        bart = BartForConditionalGeneration(BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
            max_position_embeddings=64)).eval()
        t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)).eval()
        source, padding = torch.tensor([[5, 6, 7, 2], [5, 6, 2, 1]]), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
        target = torch.tensor([[2, 8, 9, 10, 11, 12, 13, 14, 15]] * 2)
        with torch.no_grad():
            for model in (bart, t5):
                model(input_ids=source, attention_mask=padding, decoder_input_ids=target)
                model.generate(input_ids=source, attention_mask=padding, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    """
    status, alarms, report = _alarms(tmp_path, "encoder_decoders", source)
    assert (status, alarms) == (0, []), report
    assert "encoder_attn" in report and "EncDecAttention" in report and "full (--kv-len 4" not in report  # (padded: 4,3)


def test_no_alarm_on_gemma3_with_an_image_longer_than_its_sliding_window(tmp_path):
    """Gemma3ForConditionalGeneration built from its config (a 1-layer SigLIP tower, 4 tokens per image) with a
    sliding window of 2: transformers' own sliding mask lets the image's first token see its last."""
    pytest.importorskip("transformers")
    source = """
        import torch
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration
        torch.manual_seed(0)
        config = Gemma3Config(
            text_config=dict(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=8, sliding_window=2, layer_types=["sliding_attention", "full_attention"]),
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                               patch_size=4),
            mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298)
        model = Gemma3ForConditionalGeneration(config).eval()
        ids = torch.tensor([[5, 6, 297] + [299] * 4 + [298, 7, 8]])
        with torch.no_grad():
            model(input_ids=ids, pixel_values=torch.randn(1, 3, 16, 16), token_type_ids=(ids == 299).long(),
                  attention_mask=torch.ones_like(ids))
    """
    status, alarms, report = _alarms(tmp_path, "gemma3_image", source)
    assert (status, alarms) == (0, []), report


def test_no_alarm_on_packed_training_batches_run_with_use_cache_false(tmp_path):
    """DataCollatorWithFlattening's batches (position_ids alone, and with cu_seq_lens_* for flash) through Llama and
    Qwen2 in train mode with use_cache=False, as Trainer runs them: sdpa reads the documents off position_ids."""
    pytest.importorskip("transformers")
    source = """
        import torch
        from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
        torch.manual_seed(0)
        samples = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
        for cls, cfg in ((LlamaForCausalLM, LlamaConfig), (Qwen2ForCausalLM, Qwen2Config)):
            model = cls(cfg(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1)).train()
            for flash_kwargs in (False, True):
                batch = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=flash_kwargs)(
                    [{"input_ids": s, "labels": s} for s in samples])
                model(**batch, use_cache=False).loss.backward()
    """
    status, alarms, report = _alarms(tmp_path, "flattened_training", source)
    assert (status, alarms) == (0, []), report
    assert "document(0,0,0,0,1,1,1,2,2,2,2,2)" in report


def test_no_alarm_on_two_batches_generated_one_after_the_other_with_a_static_and_a_dynamic_cache(tmp_path):
    """A left-padded batch, then an unpadded one, through generate: the second batch's decode steps are read against
    its own prefill, not the first batch's padding (checks/steps.py sites). transformers 5.24 passes no cache_position
    and hands a static cache's model call a 4-D mask over every slot (generation/utils.py); the queries sit at the
    cache's start, as many as it holds (cache_utils.py StaticLayer.get_seq_length), not at the end of its slots."""
    pytest.importorskip("transformers")
    source = """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=1)
        model = LlamaForCausalLM(config).eval()
        padded = torch.tensor([[0, 0, 1, 5, 6, 7], [1, 8, 9, 10, 11, 12]])
        swapped, short = padded.flip(0), torch.tensor([[1, 3, 4], [1, 8, 9]])
        # (a site's first call is read as step 0 by every rule: the static cache's prefills come later)
        for cache, ids in (("dynamic", padded), ("dynamic", short), ("static", padded), ("dynamic", swapped),
                           ("static", padded)):
            model.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=3, do_sample=False,
                           cache_implementation=cache, pad_token_id=0)
    """
    status, alarms, report = _alarms(tmp_path, "hf_two_batches", source)
    assert (status, alarms) == (0, []), report


def test_padding_the_model_call_marks_and_lost_at_decode_is_said_once_per_step(tmp_path):
    """thu-nics/C2C#19 (tests/data/bugs/decode_mask_sliced.py): each decode step's query sees key 0, which the
    attention_mask given to the model marks as padding: one finding per step, padding-ignored, that names the
    argument, not a second padding-lost on the same cells. Without the model's argument, padding-lost still speaks."""
    from checkbugs import traced

    status, found, report = traced(tmp_path, "decode_mask_sliced", fixed=False)
    codes = [f["code"] for f in found if f["code"].startswith("padding")]
    assert status == 1 and codes == ["padding-ignored", "padding-ignored"], report
    status, found, report = traced(tmp_path, "padding_mask_first_step_only", fixed=False)
    assert [f["code"] for f in found if f["code"].startswith("padding")] == ["padding-lost", "padding-lost"], report


def test_a_hugging_face_model_given_no_attention_mask_at_decode_is_said_once_per_group(tmp_path):
    """The left padding dropped at decode inside the model (LlamaModel called with attention_mask=None once a token is
    cached) while generate hands LlamaForCausalLM the padded attention_mask: padding-ignored, once for the decode
    step's group of both layers, and no padding-lost beside it."""
    pytest.importorskip("transformers")
    source = """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)
        model = LlamaForCausalLM(config).eval()
        inner = model.model.forward
        def forward(*args, **kwargs):
            if kwargs["input_ids"].shape[1] == 1:
                kwargs["attention_mask"] = None  # the bug: the padding dropped at decode
            return inner(*args, **kwargs)
        model.model.forward = forward
        ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
        model.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=2, do_sample=False, pad_token_id=0)
    """
    status, alarms, report = _alarms(tmp_path, "hf_padding_dropped", source)
    assert status == 1 and [f["code"] for f in alarms] == ["padding-ignored"], report


def test_is_causal_at_decode_is_said_once_per_step_by_the_finding_that_names_it(tmp_path):
    """tests/data/bugs/sdpa_is_causal_decode.py: is_causal=True with one query and a cache is top-left (SDPA's
    is_causal is torch.tril of an (Lq, Lk) matrix: torch/nn/functional.py 6360, the reference implementation in
    scaled_dot_product_attention's docstring, temp_mask = torch.ones(L, S).tril(diagonal=0)): the decode mask is causal aligned
    top-left too, and steps.py's top-left-mask would say the same cells again. One finding per decode step, the one
    naming is_causal; the call with is_causal fixed to a bottom-right mask has neither."""
    from checkbugs import traced

    status, found, report = traced(tmp_path, "sdpa_is_causal_decode", fixed=False)
    assert status == 1 and [f["code"] for f in found] == ["top-left-causal", "top-left-causal"], report
    status, found, report = traced(tmp_path, "sdpa_is_causal_decode", fixed=True)
    assert status == 0 and not [f for f in found if f["code"].startswith("top-left")], report


QUIET_BLIND = Path(__file__).parent / "data" / "quiet_blind"
_FLEX = {"packed_documents_flex_cu_seqlens", "self_forcing_block_causal_video",  # dynamo's guards: own process
         "modded_nanogpt_flex_long_short_window_blockmasks", "flex_packed_prefix_lm_documents_and_or_masks_softcap",
         "nat_neighborhood_attention_flex_clamped_windows",
         "lingua_mask_string_causal_sdpa_flex_block_causal", "trl_dpo_padding_free_position_ids_flex_document_mask",
         "quiet_lingua_flex_doc_causal_block_mask",
         "quiet_selfforcing_wan_blockwise_causal_flex", "quiet_torchtune_packed_flex_block_causal",
         "quiet_transfusion_pytorch_flex_modality_bidirectional_spans", "quiet_self_forcing_wan_blockwise_causal_frame_flex_mask"}
# programs that patch a library for the rest of the process (kvpress wraps every function of transformers'
# ALL_ATTENTION_FUNCTIONS, and never unwraps them: a later test's Marian would look for kvpress's attributes)
_APART = {"quiet_kvpress_duo_attention_streaming_heads_fake_keys_question_decode"}
# softmax over the queries (slot attention's slots compete for each input): not attention over keys, so no call is
# recorded, and the report says 0 calls rather than reading the slots as keys; and BiDAF's trilinear similarity (a
# Linear over [p; q; p * q], no product of queries and keys) is scores trace does not know as such
# HSTU's pointwise attention (SiLU of the scores times a 0/1 validity mask, no softmax) is no softmax attention either
_NO_CALL = {"slot_attention_softmax_over_slots_no_mask", "allennlp_bidaf_masked_softmax_renormalised",
            "hstu_jagged_histories_silu_pointwise_attention_causal_valid_mask",
            "flax_packed_segments_causal",  # (numpy alone, a port of flax's masks: trace follows torch's calls)
            # DynamicViT's softmax_with_policy is written out (exp, times the policy, over its sum: no softmax call), and
            # ProteinMPNN's softmax is over each residue's k gathered neighbours (no query-by-key matrix of positions)
            "dynamicvit_softmax_with_policy", "proteinmpnn_random_decoding_order",
            # Tacotron 2's location-sensitive attention scores each text position by v·tanh(Wq + Wk + loc), one query a
            # decoder step: additive energies, no product of queries and keys for trace to know as scores
            "quiet_tacotron2_location_attention_padded_memory",
            # LMDeploy's paged prefill kernel ported as its online softmax over key tiles (exp, a running max and sum: no
            # softmax call), its reference a softmax of one query row at a time (a vector, no query-by-key matrix)
            "quiet_lmdeploy_paged_prefill_history_window",
            # mTAN's per-feature attention: scores repeated along a feature axis (B, H, Lq, Lk, D), softmaxed over the
            # keys' axis -2, not the last: no call read
            "quiet_mtan_physionet_padded_irregular_series_per_feature_mask",
            # Point Transformer's vector attention: an MLP of q - k per gathered neighbour, a softmax over the k
            # neighbours of each channel (b, i, j, d), no product of queries and keys
            "quiet_point_transformer_padded_point_sets_knn_vector_attention",
            # QCNet's graph attention: torch_geometric's softmax over the edges into each node (a scatter of exp over
            # edge lists), no query-by-key matrix of positions
            "quiet_qcnet_agent_encoder_time_pl2a_a2a_edges",
            # Reformer's local attention normalises by hand, exp(scores - logsumexp(scores)): no softmax call; DeepSpeed's
            # block-sparse softmax runs over block scores concatenated per block row, no query-by-key matrix trace made
            "quiet_transformers_reformer_local_chunks_look_back_causal_right_padded",
            "quiet_deepspeed_fixed_sparsity_layout_blocksparse_bert_key_padding",
            # EGT's attention is a @torch.jit.script function: it runs as TorchScript, unseen (trace/patch.py keeps the
            # functions trace swaps compilable, so the program runs to its end under trace)
            "quiet_egt_edge_augmented_graph_transformer_padded_molecules_gated_mask"}
# a finding that is true of a correct program: fairseq's left-padded prefix at step 0 leaves its padded queries' rows
# NaN (a softmax of all -inf, pytorch/pytorch#41508), which nothing reads later; whether a program zeroes or reads such
# rows no trace sees (test_checks_kernels.py keeps them suspicious), so the one finding is that, and no other
_TRUE = {"fairseq_mha_prev_key_padding_mask_left_pad_prefix_beam": {("fully-masked", "suspicious")}}
# a program written as correct that is not: PatchTST's band of +-2 patches leaves the last pad patch of a series of 4 in
# 7 no key (a NaN row), which layer 2 reads as keys and values (0 * NaN) and carries in `prev`, so that series' real
# outputs are NaN; its check passed only because Python's max(0.0, nan) is 0.0. The finding that names it, and no other
_WRONG = {"patchtst_key_padding_residual_attention": {"nan-spread"}}
# correct programs on which a suspicion is still said, not yet ended (docs/checks.md names each): ExecuTorch's ring
# cache (its key columns are ring slots, `cache_positions` not read, so a wrapped chunk's older slots read as later
# keys and the window read backwards), torchaudio's Emformer (queries [right context | utterance] over keys
# [memory | right context | left context | utterance]: no query sits at the end of the keys). Exactly these, no more
_OPEN = {"quiet_executorch_ring_kv_cache_sliding_window_batched_chunked_prefill_decode": {
    ("sees-later", "suspicious"), ("polarity", "suspicious")},
    "quiet_torchaudio_emformer_left_context_right_context_padded_batch_and_streaming_infer": {
    ("sees-later", "suspicious")}}
_HF = {p.stem for p in QUIET_BLIND.glob("hf_*.py")} | {  # (built from transformers' classes, or importing it: skipped
    p.stem for p in QUIET_BLIND.glob("*.py") if imports_transformers(p)}


@pytest.mark.parametrize("name", sorted(p.stem for p in QUIET_BLIND.glob("*.py")))
def test_no_alarm_on_correct_programs_written_blind(tmp_path, name):
    """tests/data/quiet_blind: correct programs written, as their projects write them (MANIFEST_quiet-b.md,
    MANIFEST_quiet-c.md to MANIFEST_quiet-f.md name each one's upstream code), by a helper who had
    not read the rules: no wrong or suspicious finding, exit 0."""
    if name in _HF:
        pytest.importorskip("transformers")
    out = tmp_path / f"{name}.json"
    program = QUIET_BLIND / f"{name}.py"
    if name in _FLEX or name in _APART:
        done = subprocess.run([sys.executable, "-m", "maskcli", "trace", "--json", str(out), str(program)],
                              capture_output=True, text=True, timeout=300)
        status, report = done.returncode, done.stdout + done.stderr
    else:
        result = runner.invoke(app, ["trace", "--json", str(out), str(program)])
        status, report = result.exit_code, result.output
    data = json.loads(out.read_text())
    assert data["exit_status"] == 0 and bool(data["calls"]) == (name not in _NO_CALL), report
    alarms = [f for g in data["groups"] for f in g["findings"] if f["severity"] in ("wrong", "suspicious")]
    if name in _WRONG:
        assert status == 1 and {f["code"] for f in alarms if f["severity"] == "wrong"} == _WRONG[name], report
        return
    if name in _OPEN:
        assert status == 0 and {(f["code"], f["severity"]) for f in alarms} == _OPEN[name], report
        return
    if name in _TRUE:
        assert status == 0 and {(f["code"], f["severity"]) for f in alarms} == _TRUE[name] and "NaN weights" in report, report
        return
    assert (status, alarms) == (0, []), report
