"""checks/config.py: each layer's mask against the model's config as transformers reads it, on reproductions of
published bugs (tiny Hugging Face models whose registered attention function carries the bug)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import maskcli
from checkbugs import ROWS, caught, check_bug, first, traced
from maskcli.checks.config import Placed, layer_kind, real
from maskcli.checks.real import slack_dropped
from maskcli.checks.registry import severity


def test_a_models_own_config_without_transformers(tmp_path):
    # ml-explore/mlx-lm#390: the window mask one key too wide, the window read from a plain torch model's config
    check_bug(tmp_path, "window_mask_one_too_many", "window-off-by-one")

BUGS = [
    ("hf_window_off_by_one", "window-off-by-one"),  # huggingface/transformers#39408: window_size=(W, W)
    ("hf_window_ignored", "window-missing"),  # unslothai/unsloth#8253: the window never reached SDPA
    ("hf_qwen2_window_layers", "window-on-full-layer"),  # huggingface/transformers#35924, fixed by #36162
    # rajveer43/VeloxQuant-MLX#463 (written blind): the streaming sink cache's N == 1 shortcut drops window_size
    ("veloxquant_streaming_sink_cache_decode_drops_window", "window-missing"),
]
BLIND = [  # the third blind batch, caught by rules not written for them
    # sgl-project/sglang#10172: an ENCODER_ONLY RadixAttention layer run causal by the FA3 backend (attn_type stated)
    ("sglang_fa3_backend_encoder_only_layers_run_causal", "bidirectional-run-causal"),
    # sgl-project/sglang#35434 (written blind): the CPU extend kernel's stage 2 always causal, the layer an nn.Module
    # RadixAttention built with attn_type=AttentionType.ENCODER_ONLY (its own attribute, no config); its fix's per-request
    # softmaxes over a ragged batch are no padded batch (checks/ragged.py: no padding-unused)
    ("sglang_cpu_extend_attention_encoder_only_causal", "bidirectional-run-causal"),
    # huggingface/transformers#40324: Llama 4 chunks counted from column 0 of a left-padded row (its decode step,
    # fixed, is quiet since boundaries.py carries the prefill's padding behind the cache)
    ("transformers_llama4_chunked_mask_ignores_left_padding", "chunks-misaligned"),
    # vllm-project/vllm#9679 (written blind): the V1 backend object holds window_size=(W, W) beside the model's dict
    # config (sliding_window=W): the dict, not the backend's kernel bounds, states the window
    ("vllm_v1_flash_attn_sliding_window_plus_one", "window-off-by-one"),
    # vllm-project/vllm#4405 (written blind): a prefix prefill's context scores and new-token scores joined along the
    # keys for one softmax (scores.py), the cached context's unused block slots between them dropped (checks/real.py)
    ("vllm_prefix_prefill_context_ignores_sliding_window", "window-missing"),
    # NVIDIA/TensorRT-Model-Connect#400 (written blind): gpt-oss's sliding layers given the full causal mask, the
    # softmax over scores joined to a learned sink column (scores.py leaves it out) and a dict config's layer_types
    ("gptoss_engine_sliding_layers_full_causal_mask", "window-missing"),
    # huggingface/transformers#40163 (fixes #39408; blind-ax, the same bug as hf_window_off_by_one by another hand): the
    # flash path's window_size=(W, W) against a plain class config's sliding_window=W
    ("transformers_flash_attention_sliding_window_one_key_too_many", "window-off-by-one"),
    # onnxruntime/mobius#371 (written blind, batch blind-aw): the direct GQA path's GQAContext never set
    # local_window_size, so a dataclass config's sliding_window (every layer_types entry sliding) ran full causal,
    # prefill and cached decode
    ("mobius_direct_gqa_path_drops_sliding_window", "window-missing"),
    # ARISE-Initiative/robomimic#196 (written blind, blind-hs, caught before tuning): `algo.transformer.causal = False`
    # dropped on its way from the config to GPT_Backbone, whose tril buffer keeps every block causal
    ("robomimic_bc_transformer_causal_false_config_ignored", "bidirectional-run-causal"),
    # ModelTC/LightLLM#469 (written blind, blind-pv, caught before tuning): Qwen2's `sliding_window` run on every layer
    # beside `use_sliding_window: false`; its fix's decode, which pools one request's heads at a time beside every
    # request's `b_seq_len`, was read as pooled over padding (checks/pooledpad.held_there reads no lengths over rows of
    # another axis now)
    ("lightllm_qwen2_sliding_window_applied_without_use_sliding_window", "window-on-full-layer"),
]


@pytest.mark.parametrize("name, code", BLIND)
def test_blind_reproductions_of_a_stated_intent_are_flagged(tmp_path, name, code):
    check_bug(tmp_path, name, code)


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    pytest.importorskip("transformers")
    check_bug(tmp_path, name, code)


def test_layer_kinds_are_read_as_transformers_reads_them():
    """Qwen2's layer_types come from use_sliding_window and max_window_layers (transformers/models/qwen2/
    configuration_qwen2.py lines 87-91: sliding where i >= max_window_layers); a config without layer_types is
    sliding wherever sliding_window is set and use_sliding_window is not False."""
    transformers = pytest.importorskip("transformers")
    MistralConfig, Qwen2Config = transformers.MistralConfig, transformers.Qwen2Config

    qwen = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    expected = ["sliding_attention" if i >= qwen.max_window_layers else "full_attention" for i in range(4)]
    assert [layer_kind(qwen, i)[0] for i in range(4)] == expected
    assert layer_kind(qwen, 4) is None

    class Old:  # a config of transformers 4, before layer_types
        sliding_window = 4096
        use_sliding_window = False

    assert layer_kind(Old(), 0)[0] == "full_attention"
    Old.use_sliding_window = True
    assert layer_kind(Old(), 3) == ("sliding_attention", "sliding_window=4096")
    assert layer_kind(MistralConfig(sliding_window=None), 0)[0] == "full_attention"


def test_a_config_of_the_programs_own_with_a_pattern_of_its_own_says_no_layer_kind():
    """nanochat's GPTConfig keeps its windows in a window_pattern the model reads itself: a config of the program's
    own that states none of the fields but a per-layer pattern says nothing of a layer's kind (prefill.py once held
    its chunks to causal from it); one with no such field, and transformers' config with no window field, are full."""
    transformers = pytest.importorskip("transformers")
    from dataclasses import dataclass

    @dataclass
    class GPTConfig:
        n_layer: int = 2
        window_pattern: str = "SL"

    assert layer_kind(GPTConfig(), 0) is None and layer_kind({"n_layer": 2, "window_pattern": "SSL"}, 1) is None
    assert layer_kind({"n_layer": 2}, 1)[0] == "full_attention"
    assert layer_kind(transformers.LlamaConfig(num_hidden_layers=2), 1)[0] == "full_attention"


# The stated intent read from wherever a program keeps it (checks/intent.py): each reading by two programs written
# differently (tests/data/intent, each taking --fixed), the finding naming where the field was stated.
INTENT = Path(__file__).parent / "data" / "intent"
PROGRAMS = [
    # a dataclass on self.cfg, a left-padded batch with its attention_mask; a dict at the main module's top level
    ("window_dataclass_left_padded", (), "window-off-by-one", "sliding_window=3 (self.cfg of Decoder (Cfg))"),
    ("window_dict_builder", (), "window-off-by-one", "sliding_window=4 (hf_config (dict) at the top of window_dict_builder.py)"),
    # a NamedTuple at the top of the module that defines the model (not the main program's), its layers by their turn
    ("namedtuple_in_model_module", (), "window-off-by-one", "sliding_window=3 (ARGS (ModelArgs) at the top of namedtuple_model_lib.py)"),
    # the window gone at decode, a left-padded batch, a SimpleNamespace on self.args (its prefill keeps the window)
    ("window_gone_at_decode", (), "window-missing", "sliding_window=3 (self.args of Decoder (SimpleNamespace))"),
    # a prefixed field (`attention_sliding_window`) in a top-level dict beside its convolutions' strides, never applied
    ("tts_decoder_attention_sliding_window_unused", (), "window-missing", "attention_sliding_window=6 (CONFIG (dict) at the top of"),
    # layer types by index against a dataclass's layer_types; against a SimpleNamespace's pattern in main()
    ("types_by_index_dataclass", (), "window-on-full-layer", "layer_types[0] (self.config of Model (ModelConfig))"),
    ("types_by_index_dataclass", (), "window-missing", "sliding_window=2 (self.config of Model (ModelConfig))"),
    ("types_by_index_pattern", (), "window-on-full-layer", "sliding_window_pattern=2 (args (SimpleNamespace) in main() of"),
    ("types_by_index_pattern", (), "window-missing", "sliding_window=3 (args (SimpleNamespace) in main() of"),
    # is_causal=False on a dataclass, right-padded; bidirectional=True in a top-level dict handed to a builder
    ("encoder_is_causal_false", (), "bidirectional-run-causal", "is_causal=False (self.config of Embedder (EmbedderConfig))"),
    ("encoder_bidirectional_dict", (), "bidirectional-run-causal", "bidirectional=True (config (dict) at the top of"),
    # an attention module's own attn_type (a str constant, vLLM's AttentionType) says ENCODER_ONLY; the backend runs causal
    ("encoder_only_attention_type_str", (), "bidirectional-run-causal", "attn_type='ENCODER_ONLY' (self.attn_type=encoder_only of layers.0.attn)"),
    # the model's own `self.is_causal = False` (no config), a right-padded batch, SDPA with a bool keep-mask and-ed causal
    ("model_is_causal_false_sdpa", (), "bidirectional-run-causal", "is_causal=False (self.is_causal=False of Denoiser)"),
    # use_bidirectional_attention="all" (Gemma 4's string, not a bool) in a dict on self.cfg, left-padded, additive mask
    ("encoder_bidirectional_all_dict", (), "bidirectional-run-causal", "use_bidirectional_attention='all' (self.cfg of Encoder (dict))"),
    # a one-sided window where use_bidirectional_attention (hparams) or causal=False (argparse) says both ways
    ("symmetric_window_hparams", (), "window-one-sided", "sliding_window=3 (self.hparams of LocalEncoder (HParams))"),
    ("symmetric_window_namespace", (), "window-one-sided", "window_size=2 (args (Namespace) at the top of"),
    # attention_chunk_size: cut from column 0 of a left-padded row; missing; one too long (a dict in main())
    ("chunks_left_padded", (), "chunks-misaligned", "attention_chunk_size=3 (self.cfg of layers.0 (TextConfig))"),
    ("chunks_dict_builder", (), "chunks-missing", "attention_chunk_size=4 (params (dict) in main() of"),
    ("chunks_dict_builder", ("--bug", "size"), "chunks-off-by-one", "attention_chunk_size=4 (params (dict) in main() of"),
    # Qwen2's max_window_layers read the wrong way round: a dict held as self.config (its layers found by their turn)
    ("qwen2_dict_window_layers", (), "window-on-full-layer", "max_window_layers=2 (self.config of Qwen2Port (dict))"),
    # a kernel spec the model holds states causal and window_size=(3, 0) only: the window is the config.json's it was
    # built from (kept as text at the top of the program, parsed in main())
    ("window_built_from_json_config", (), "window-off-by-one", "sliding_window=3 (hf (dict) in main() of"),
    # an engine's backend object (no module) holds its kernel's bounds sliding_window=(W, 0) converted from the
    # dataclass config in the serving function: the config states the window, the bounds reach one key past it
    ("engine_backend_window_plus_one", (), "window-off-by-one", "sliding_window=3 (model_config (EngineModelConfig) in serve() of"),
    # the same bug as vllm#4405 written otherwise: 4-D batched scores, matmul, a bool masked_fill, a SimpleNamespace
    ("prefix_prefill_joined_scores_no_window", (), "window-missing", "sliding_window=3 (ENGINE (SimpleNamespace) at the top of"),
    # Megatron's interleaved_attn_pattern (local, global) in a dict held as self.cfg, a 0-based index read as 1-based:
    # layer 5 (global by the period) windowed, on a left-padded batch (the same kind as Megatron-Bridge#5441)
    ("interleaved_pattern_dict_left_padded_off_by_one", (), "window-on-full-layer",
     "interleaved_attn_pattern=(5, 1) (self.cfg of Model (dict))"),
]


@pytest.mark.parametrize("name, args, code, source", PROGRAMS)
def test_intent_read_wherever_the_program_keeps_it(tmp_path, name, args, code, source):
    flagged = check_bug(tmp_path, name, code, INTENT, args)
    assert any(f["source"].startswith(source) for f in flagged), flagged


def test_qwen2_layers_built_by_hand_from_transformers_config(tmp_path):
    # Qwen2Config's own layer_types (sliding from max_window_layers on) against a program reading it the other way
    pytest.importorskip("transformers")
    flagged = check_bug(tmp_path, "qwen2_config_by_hand", "window-on-full-layer", INTENT)
    assert flagged[0]["source"] == "layer_types[0] (self.config of HandBuiltQwen2 (Qwen2Config))", flagged


def test_qwen2_use_sliding_window_read_the_wrong_way_round(tmp_path):
    # Qwen2Config(use_sliding_window=False): transformers keeps no window (sliding_window None, every layer full), so
    # any window on its layers contradicts it, whatever its size
    pytest.importorskip("transformers")
    flagged = check_bug(tmp_path, "qwen2_use_sliding_window", "window-on-full-layer", INTENT)
    assert "use_sliding_window=False" in flagged[0]["message"] and "window of 3 keys" in flagged[0]["message"], flagged


def reference(lengths, size, length, left, kind="window", padding_sees="all"):
    """Bool (B, 1, L, L) by a double loop over positions: `kind` on each row's real keys; a padding query row sees every
    key (as transformers unmasks it), itself, or nothing: the rules must not judge it."""
    keep = np.zeros((len(lengths), 1, length, length), bool)
    for b, real in enumerate(lengths):
        first = length - real if left else 0
        for q in range(length):
            for k in range(length):
                if not first <= q < first + real:
                    keep[b, 0, q, k] = padding_sees == "all" or padding_sees == "self" and q == k
                elif first <= k < first + real:
                    keep[b, 0, q, k] = k <= q and q - k < size if kind == "window" else abs(q - k) < size
    return keep


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("padding_sees", ["all", "self", "none"])
def test_a_window_is_judged_per_row_on_real_queries_and_keys(left, padding_sees):
    lengths, size, length = [5, 8, 3], 3, 8
    own = np.arange(length)
    given = np.array([[int((length - n <= k) if left else k < n) for k in range(length)] for n in lengths]) != 0
    for kind, holds, not_held in (("window", f"window({size})", ("causal", f"band({size})")),
                                  ("band", f"band({size})", ("full", f"window({size})"))):
        keep = reference(lengths, size, length, left, kind, padding_sees)
        for real_k in (given, real(keep, own, None)[0]):  # the model call's attention_mask; else read off the mask
            placed = Placed(keep, own, real_k[:, own], real_k)
            assert placed.holds(holds), (kind, real_k)
            assert not any(placed.holds(other) for other in (*not_held, f"{kind}({size + 1})", f"{kind}({size - 1})"))


class _Layer(torch.nn.Module):
    def __init__(self, window):
        super().__init__()
        self.window = window

    def forward(self, x):
        n = x.shape[-2]
        keep = torch.ones(n, n, dtype=torch.bool).tril()
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=keep.triu(1 - self.window) if self.window else keep)


def _codes(model, x=None):
    with maskcli.trace() as t, torch.no_grad():
        model(torch.randn(1, 1, 6, 4) if x is None else x)
    return sorted({(f.code, severity(f)) for group in t.groups() for f in group.findings if severity(f) != "note"})


def test_configs_that_disagree_or_say_nothing_of_the_layers_stay_quiet():
    class Held(torch.nn.Module):
        def __init__(self, configs, windows):
            super().__init__()
            self.cfg, self.args = configs
            self.layers = torch.nn.ModuleList(_Layer(w) for w in windows)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    # two configs that state different windows: neither is the expectation
    assert _codes(Held(({"sliding_window": 3}, {"sliding_window": 2}), [2, 2])) == []
    # the same window stated twice is one statement: window(3) against it is an off-by-one
    assert ("window-off-by-one", "wrong") in _codes(Held(({"sliding_window": 2}, {"sliding_window": 2}), [3, 3]))
    # sliding_window alone in a hand-written config: a Gemma that alternates with nothing that says so is quiet
    assert _codes(Held(({"sliding_window": 2}, None), [2, None, 2, None])) == []
    # ... but no layer windowed at all is the window gone
    assert ("window-missing", "wrong") in _codes(Held(({"sliding_window": 2}, None), [None, None]))
    # a dict that states the window and use_sliding_window=False: a window on its layers is the flag read wrong
    assert ("window-on-full-layer", "wrong") in _codes(Held(({"sliding_window": 2, "use_sliding_window": False}, None),
                                                             [2, 2]))
    assert _codes(Held(({"sliding_window": 2, "use_sliding_window": False}, None), [None, None])) == []
    # a `window` (which may be anything) is not read; an int window_size one off is suspicious (its count unsure)
    assert _codes(Held(({"window": 2}, None), [3, 3])) == []
    assert ("window-off-by-one", "suspicious") in _codes(Held(({"window_size": 2}, None), [3, 3]))


def test_program_variables_speak_only_as_one_config():
    model = torch.nn.Sequential(_Layer(None), _Layer(None))  # holds no config: the program's variables speak
    encoder_config = {"is_causal": False}  # noqa: F841 - read from this frame by the trace
    assert ("bidirectional-run-causal", "wrong") in _codes(model)
    decoder_config = {"sliding_window": 4}  # noqa: F841 - a second config: which one is the model's is not known
    assert _codes(model) == []


def test_a_config_that_copies_part_of_another_adds_nothing_to_it():
    # a runtime's copy of the model's window (vLLM's cache_config.sliding_window) beside the config that states the
    # layers' types: the copy says nothing the model's config does not, so the model's config speaks alone
    model = torch.nn.Sequential(_Layer(3), _Layer(3))  # both layers windowed
    model_config = {"sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"]}  # noqa: F841 - read by trace
    cache_config = {"sliding_window": 3}
    assert _codes(model) == [("window-on-full-layer", "wrong")]
    cache_config["sliding_window"] = 5  # a copy that says another window: which one is the model's is not known
    assert _codes(model) == []
    cache_config["sliding_window"], cache_config["is_causal"] = 3, True  # a config that states more than a copy
    assert _codes(model) == []


def test_the_model_wide_window_a_full_layer_falls_back_to(tmp_path):
    # vllm-project/vllm#21863 (written blind): Gemma3n's full layer (layer_types[3], window None) falls back to
    # cache_config.sliding_window, the copy of hf_config's window; the fix leaves the runtime's window None
    check_bug(tmp_path, "vllm_gemma3n_global_layers_fall_back_to_sliding_window", "window-on-full-layer")
    # written another way: a dataclass ModelArgs and a runtime dict, a right-padded batch, eager softmax
    check_bug(tmp_path, "runtime_window_copied_onto_full_layers", "window-on-full-layer", WINDOWS)


def test_a_bidirectional_said_of_another_part_is_suspicious():
    model = torch.nn.Sequential(_Layer(None), _Layer(None))
    rnn_config = {"hidden_size": 8, "bidirectional": True}  # noqa: F841 - an LSTM's, maybe: nothing names attention
    assert _codes(model) == [("bidirectional-run-causal", "suspicious")]
    del rnn_config
    attention_config = {"num_attention_heads": 2, "bidirectional": True}  # noqa: F841 - read from this frame
    assert _codes(model) == [("bidirectional-run-causal", "wrong")]


def test_a_config_a_module_holds_speaks_for_that_module_alone():
    class Encoder(torch.nn.Module):
        def __init__(self, causal):
            super().__init__()
            self.config = {"num_attention_heads": 1, "is_causal": False}  # the encoder's own, as a vision tower's
            self.layer = _Layer(None) if causal else _Full()

        def forward(self, x):
            return self.layer(x)

    class EncoderDecoder(torch.nn.Module):
        def __init__(self, causal):
            super().__init__()
            self.encoder, self.decoder = Encoder(causal), _Layer(None)

        def forward(self, x):
            return self.decoder(self.encoder(x))

    assert _codes(EncoderDecoder(causal=False)) == []  # the causal decoder is not the encoder's config's
    with maskcli.trace() as t, torch.no_grad():
        EncoderDecoder(causal=True)(torch.randn(1, 1, 6, 4))
    flagged = [(group.first.where, f.code) for group in t.groups() for f in group.findings if severity(f) == "wrong"]
    assert flagged == [("encoder.layer", "bidirectional-run-causal")], flagged


class _Full(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.scaled_dot_product_attention(x, x, x)


def test_a_config_the_class_keeps_is_read():
    class Windowed(torch.nn.Module):
        config = {"sliding_window": 2}  # a class attribute, not the instance's

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([_Layer(3), _Layer(3)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    assert ("window-off-by-one", "wrong") in _codes(Windowed())


WINDOWS = Path(__file__).parent / "data" / "windows"

BLIND = [  # written blind by other helpers (tests/data/bugs), each caught and its fix quiet
    ("mistral_sdpa_mask_drops_sliding_window", "window-missing"),  # huggingface/transformers#30127
    # Blaizzy/mlx-audio 0570bb1b (batch blind-gg): Voxtral's codec decoder never applies attn_sliding_window_size
    ("mlx_audio_voxtral_tts_codec_decoder_alibi_reversed_no_window", "window-missing"),
    ("mistral_sliding_window_causal_mask_decode", "window-off-by-one"),  # huggingface/transformers#26792
    ("sglang_torch_native_backend_ignores_sliding_window", "window-missing"),  # sgl-project/sglang#26516 (layer_id)
    ("sglang_torch_native_encoder_sliding_window_ignored", "window-missing"),  # sgl-project/sglang#39298 (no module)
    # Lightning-AI/litgpt#2153: a bool decode mask the -inf window bias is or-ed into (sliding_window_size, dataclass)
    ("litgpt_gemma3_sliding_window_lost_with_kv_cache", "window-missing"),
    # NVIDIA/TensorRT-LLM#12597: MistralAttention inherits forward, so config.sliding_window never reaches the kernel
    ("tensorrt_llm_pytorch_mistral_sliding_window_not_passed", "window-missing"),
    # microsoft/unilm#1612 (batch blind-nw): YOCO's sliding layer takes one off its window when it stores it and again
    # when it hands flash attention window_size, so each query sees W - 1 keys (caught before any rule changed for it)
    ("yoco_swa_window_size_minus_one_twice", "window-off-by-one"),
]


@pytest.mark.parametrize("name, code", BLIND)
def test_blind_window_bugs_are_flagged_and_their_fixes_are_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


@pytest.mark.parametrize("name", ["layer_idx_unnumbered_paths", "plain_object_window_no_module",
                                  "window_size_field_decode_left_padded"])
def test_a_layer_placed_by_its_own_number_or_stated_outside_any_module(tmp_path, name):
    # the second way of each: layers under names (their layer_idx says which), a plain object with no nn.Module; a
    # window named sliding_window_size in a dict (self.hparams), lost at decode on a left-padded batch
    check_bug(tmp_path, name, "window-missing", WINDOWS)


def test_quiet_on_a_causal_full_layer_whose_queries_sit_inside_the_window_and_a_hand_written_llama4(tmp_path):
    # gemma2 --fixed: the full layer 1 (alternating by i % 2) is causal over 5 queries, which window(5) is too: no
    # off-by-one; llama4 --fixed: no_rope_layers says layer 1 is full (configuration_llama4.py)
    from checkbugs import traced

    for name in ("gemma2_hybrid_cache_sliding_mask_slicing", "llama4_chunked_attention_cache_offset"):
        status, found, report = traced(tmp_path, name, True)
        assert status == 0 and not [f for f in found if f["severity"] == "wrong"], report


def test_an_engine_layer_object_states_an_encoder_window_both_ways():
    from maskcli.checks.intent import Intent, Stated, fields_of

    class AttentionType:  # (an Enum-like value: its name is read)
        name = "ENCODER_ONLY"

    class RadixAttention:
        def __init__(self):
            self.layer_id, self.sliding_window_size, self.attn_type = 0, 4, AttentionType()

    stated = Intent([Stated("layer", None, fields_of(RadixAttention()))])
    assert stated.window() == (5, "sliding_window_size")  # SGLang counts the keys before the query: W - 1
    assert stated.bidirectional() == "attn_type"
    decoder = Intent([Stated("layer", None, {"sliding_window_size": -1, "attn_type": "DECODER"})])
    assert decoder.window() is None and decoder.bidirectional() is None


def test_a_window_side_given_as_a_negative_number_is_found(tmp_path):
    # thu-nics/DiTFastAttn#7: window_size=[-4, 4] (argparse window_size=4); flash reads -4 as no limit behind
    found = check_bug(tmp_path, "ditfastattn_window_size_negative_left", "window-half-missing")
    assert "every earlier key and only the 4 keys after each query" in found[0]["message"]
    assert "window_size=4 (args (Namespace) in main()" in found[0]["message"]


def test_a_window_that_lost_its_causal_side_on_a_padded_batch_is_found(tmp_path):
    found = check_bug(tmp_path, "window_lost_causal_side", "window-half-missing", WINDOWS)
    assert "the 2 keys before each query and every later one" in found[0]["message"]


def test_one_side_bounded_is_told_from_a_band_a_window_and_full():
    length, own = 9, np.arange(9)
    real_k = np.ones((1, length), bool)
    shapes = {  # by a double loop over positions
        "ahead(3)": lambda q, k: k <= q + 3, "behind(2)": lambda q, k: k >= q - 2,
        "band(4)": lambda q, k: abs(q - k) < 4, "window(3)": lambda q, k: q - 3 < k <= q, "full": lambda q, k: True}
    for name, rule in shapes.items():
        keep = np.array([[[[rule(q, k) for k in range(length)] for q in range(length)]]])
        placed = Placed(keep, own, real_k[:, own], real_k)
        assert [other for other in shapes if placed.holds(other)] == [name]


def test_mistral_one_file_ref_sliding_window_band_one_too_wide(tmp_path):
    """mistral-inference#137: triu(..., diagonal=-sliding_window) keeps sliding_window + 1 keys; the config's
    sliding_window=4 counts the query itself, so the band is one too wide (torch.tril/triu's W-1 band is the fix's)."""
    hit = check_bug(tmp_path, "mistral_one_file_ref_sliding_window_band_one_too_wide", "window-off-by-one")[0]
    assert "sees window(5), one key wider than its config's window(4)" in hit["message"]


def test_a_provider_built_from_an_hf_config_with_its_window_one_too_wide(tmp_path):
    """NVIDIA-NeMo/Megatron-Bridge#2656: the Mistral bridge hands HF's sliding_window W as window_size=(W, 0); the
    model's provider states only that tuple, so the window is read from the HF config in main() it was built from."""
    flagged = check_bug(tmp_path, "megatron_bridge_mistral_window_size_raw_hf_sliding_window", "window-off-by-one")
    assert all(f["source"].startswith("sliding_window=4 (hf_config (MistralConfig) in main() of") for f in flagged)
    assert {f["expected"] for f in flagged} == {"window(4)"}


def test_mlx_lm_gemma3_sliding_window_mask_dropped_without_cache(tmp_path):
    """mlx-lm#430: with no cache the sliding layers get the "causal" string: no window
    (written blind, batch blind-o; caught before any rule was changed for it)."""
    check_bug(tmp_path, "mlx_lm_gemma3_sliding_window_mask_dropped_without_cache", "window-missing")


def test_tgi_gaudi_qwen2_use_sliding_window_false_ignored(tmp_path):
    """text-generation-inference#3280: a Qwen2 config with use_sliding_window false still gets a banded prefill mask
    (written blind, batch blind-r; caught before any rule was changed for it)."""
    check_bug(tmp_path, "tgi_gaudi_qwen2_use_sliding_window_false_ignored", "window-on-full-layer")


def test_mlx_lm_gemma3_window_masks_from_swapped_caches(tmp_path):
    """ml-explore/mlx-lm#465 (9a11a81): Gemma 3's global and sliding masks built from each other's caches, so the
    sliding layer runs unwindowed (written blind, batch blind-ae, a torch port; caught before any rule was changed for
    it). The fix is quiet."""
    check_bug(tmp_path, "mlx_lm_gemma3_window_masks_from_swapped_caches", "window-missing")


def test_mlx_lm_step3p5_kvcache_decode_mask_drops_window(tmp_path):
    """ml-explore/mlx-lm#843 (25a4c83): KVCache.make_mask drops window_size on decode steps, so the sliding layer's
    decode sees every cached key (written blind, batch blind-ae, a torch port; caught before any rule was changed for
    it). The fix is quiet."""
    check_bug(tmp_path, "mlx_lm_step3p5_kvcache_decode_mask_drops_window", "window-missing")


def test_unused_slots_between_keys_and_before_the_queries_are_dropped():
    # a causal prefill of 3 new tokens after 5 cached ones read from 2 blocks of 4 (3 slots unused): against a double
    # loop over absolute positions, once the slots are gone the queries sit at positions 5..7
    cells = np.zeros((1, 1, 3, 11), bool)
    for m in range(3):
        for j in range(11):
            cells[0, 0, m, j] = j < 5 or 8 <= j <= 8 + m
    dropped, own = slack_dropped(cells, np.arange(8, 11))
    expected = np.array([[k <= q for k in range(8)] for q in range(5, 8)])
    assert own.tolist() == [5, 6, 7] and (dropped[0, 0] == expected).all()
    # unseen columns at the left edge (a window's old keys) or among the queries (later keys) are kept
    window = cells.copy()
    window[..., :2] = False
    kept, own = slack_dropped(window, np.arange(8, 11))
    assert kept.shape[-1] == 8 and own.tolist() == [5, 6, 7] and not kept[..., :2].any()
    assert slack_dropped(torch.ones(1, 1, 3, 6).tril(3).bool().numpy(), np.arange(3, 6))[0].shape[-1] == 6


def test_a_window_wider_than_int64_reads_as_causal():
    """hunt 8: a config's sliding_window of 2**200 (a SimpleNamespace of the program's) ended the report in "unexpected
    OverflowError"; a window past every position keeps every earlier key: the causal cells torch.tril gives."""
    length = 6
    causal = torch.ones(length, length, dtype=torch.bool).tril().numpy()[None, None]
    real_k = np.ones((1, length), bool)
    placed = Placed(causal, np.arange(length), real_k, real_k)
    assert placed.holds(f"window({2 ** 200})") and placed.holds(f"window({2 ** 63 - 1})")
    assert not placed.holds("window(3)")


def test_an_attention_modules_own_attn_type_is_read_beside_the_configs():
    """trace/stated.py's _kinds: a module's own attn_type / attention_type among SGLang's and vLLM's words (an Enum's
    name or a str) states its kind for the calls under it, and hides no config variable of the program (a GPT-Neo
    layer's attention_type="local" is no such word)."""
    from enum import Enum

    import torch

    from maskcli.checks.intent import Intent, Stated, stated_for
    from maskcli.trace.stated import _kinds

    class AttentionType(Enum):
        ENCODER_ONLY = "encoder_only"

    model = torch.nn.Module()
    model.enc, model.dec, model.neo = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    model.enc.attn_type, model.dec.attention_type, model.neo.attention_type = AttentionType.ENCODER_ONLY, "decoder", "local"
    found = _kinds(model, lambda module: next(name for name, m in model.named_modules() if m is module))
    assert [(one.scope, one.fields) for one in found] == [("enc", {"attn_type": "ENCODER_ONLY", "own": True}),
                                                          ("dec", {"attention_type": "DECODER", "own": True})]
    top = type("Top", (), {"stated": (*found, Stated("cfg (dict) at the top of p.py", None, {"sliding_window": 3}))})
    assert Intent(stated_for(top, "enc")).bidirectional() == "attn_type"
    assert Intent(stated_for(top, "enc")).get("sliding_window") == 3  # (the program's config still speaks)
    assert Intent(stated_for(top, "dec")).bidirectional() is None
def test_a_layers_own_attn_type_says_its_kind_over_a_window_every_layer_carries():
    """AI Edge Torch's Gemma 2 (ai-edge-torch ef37e09): every layer's AttentionConfig carries sliding_window_size and
    its attn_type (GLOBAL / LOCAL_SLIDING) says which layers use it; a GLOBAL layer's causal mask is no missing window."""
    import enum
    from types import SimpleNamespace

    class AttentionType(enum.Enum):
        GLOBAL = enum.auto()
        LOCAL_SLIDING = enum.auto()

    class Attention(torch.nn.Module):
        def __init__(self, config, window):
            super().__init__()
            self.config, self.inner = config, _Layer(window)

        def forward(self, x):
            return self.inner(x)

    def model(types, windows, held=lambda kind: SimpleNamespace(sliding_window_size=2, attn_type=kind)):
        return torch.nn.Sequential(*(Attention(held(kind), w) for kind, w in zip(types, windows)))

    sliding, full = AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL
    # the fix's pattern (even layers sliding, odd ones global) and the reverse, each applied as stated: quiet
    # (sliding_window_size=2 counts the keys before the query: window(3), or window(2) as LitGPT counts it)
    assert _codes(model([sliding, full, sliding, full], [3, None, 3, None])) == []
    assert _codes(model([full, sliding], [None, 2])) == []
    # a layer stated sliding given the plain causal mask, and a global one given the window: wrong
    assert _codes(model([sliding, full], [None, None])) == [("window-missing", "wrong")]
    assert _codes(model([sliding, full], [3, 3])) == [("window-on-full-layer", "wrong")]
    # another holder and spelling: a dict config with attention_type as a string
    as_dict = lambda kind: {"num_heads": 1, "sliding_window": 3, "attention_type": kind}  # noqa: E731
    assert _codes(model(["full", "sliding"], [None, 3], as_dict)) == []
    assert _codes(model(["full", "sliding"], [None, None], as_dict)) == [("window-missing", "wrong")]
    # a type that names no kind (vLLM's DECODER) leaves the window to every layer, as before
    decoder = lambda kind: {"sliding_window": 3, "attn_type": kind}  # noqa: E731
    assert _codes(model(["DECODER", "DECODER"], [None, None], decoder)) == [("window-missing", "wrong")]
def test_sliding_layers_full_behind_a_sink_column_written_otherwise(tmp_path):
    """#400's bug written otherwise: a dataclass's layer_types, 4-D batched scores, a per-head sink joined by
    torch.concat on dim 3. The sink column is no key: the fixed run's sliding layers are read as window(3) over the 7
    keys (no eighth column), and the buggy run's layer 1 is causal where its config says sliding."""
    found = check_bug(tmp_path, "sink_column_sliding_layers_full", "window-missing", WINDOWS)
    assert "layer 1 is a sliding layer" in found[0]["message"].replace("\n", " ")
    _, _, report = traced(tmp_path, "sink_column_sliding_layers_full", True, WINDOWS)
    assert "(2,2,7,7)  window(3)" in report and "(2,2,7,8)" not in report


def test_mimi_encoder_transformer_causal_mask_without_sliding_window(tmp_path):
    """huggingface/transformers#43971: Mimi's encoder transformer builds a plain causal mask and ignores
    config.sliding_window (batch blind-ai); written blind and caught before any rule was changed for it. The fix
    is quiet."""
    check_bug(tmp_path, "mimi_encoder_transformer_causal_mask_without_sliding_window", "window-missing")


def test_gemma4_bidirectional_all_still_causal(tmp_path):
    # huggingface/transformers#46077 (written blind, batch blind-as): use_bidirectional_attention="all" never set
    # is_causal=False, so the mask helpers built causal masks; its fix (random ids, a hand-made right-padding mask) is
    # quiet: no id is the pad id, the mask is the batch's only padding statement (checks/tokens.py's _filler)
    pytest.importorskip("transformers")
    flagged = check_bug(tmp_path, "gemma4_bidirectional_all_still_causal_mask", "bidirectional-run-causal")
    assert "use_bidirectional_attention='all'" in flagged[0]["source"]


def test_llada_masked_diffusion_run_with_the_arm_causal_mask(tmp_path):
    # LounesMD/LLaDA_Arithmetic#3 (written blind, batch blind-as): TransformerModel(causal=False) for the masked-diffusion
    # model, yet its forward always builds log(tril): the model's own flag states it bidirectional (trace/stated.py)
    flagged = check_bug(tmp_path, "llada_arithmetic_masked_diffusion_uses_causal_mask", "bidirectional-run-causal")
    assert flagged[0]["source"].startswith("causal=False (self.causal=False of TransformerModel)")


def test_a_modernbert_window_run_causal_is_its_bands_causal_half(tmp_path):
    """The fix of BONSAI#343 (tests/data/bugs) runs ModernBERT's sliding layer causal: |q - k| <= sliding_window and
    causal, sliding_window + 1 keys. ModernBertConfig's sliding_window is a half window (local_attention // 2) and
    transformers' ModernBertAttention, whose is_causal is False, adds 1 to it for the kernel's window: against
    transformers itself. So a module that states itself not causal is not one key wider than its config's window."""
    pytest.importorskip("transformers")
    from transformers import ModernBertConfig
    from transformers.models.modernbert.modeling_modernbert import ModernBertAttention

    config = ModernBertConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, local_attention=8,
                              global_attn_every_n_layers=2)
    module = ModernBertAttention(config, layer_idx=1)
    assert config.sliding_window == 4 and module.sliding_window == 5 and module.is_causal is False
    status, found, report = traced(tmp_path, "corebehrt_modernbert_is_causal_update_attention_mask_never_called", True)
    assert status == 0 and not [f for f in found if f["code"] == "window-off-by-one"], report


def test_a_layers_own_sliding_window_says_its_kind(tmp_path):
    # huggingface/transformers#35924 (fixed by #36162; written blind): Qwen2's eager mask lost the window; each layer
    # keeps its own `self.sliding_window` (4 on both: the program's reading of max_window_layers), which says it slides,
    # over transformers' direction of max_window_layers in a config that is not transformers'
    flagged = check_bug(tmp_path, "transformers_qwen2_eager_sliding_window_mask_dropped", "window-missing")
    assert {f["message"].split(" is a")[0] for f in flagged} == {"layer 0", "layer 1"}, flagged
    assert "self.sliding_window=4 of layers" in flagged[0]["message"], flagged
    # written another way: a ModelArgs dataclass, blocks that keep a window only below max_window_layers, left padding
    flagged = check_bug(tmp_path, "own_window_layers_left_padded", "window-missing", INTENT)
    assert {f["message"].split(" is a")[0] for f in flagged} == {"layer 0", "layer 1"}, flagged


def test_a_full_layers_own_none_window_beside_a_shared_config(tmp_path):
    # huggingface/transformers#31670 (written blind): Gemma 2's sliding layer zeroed FA2's 2-D padding mask (real
    # tokens masked as padding). Every layer holds the config (sliding_window=8 alone), its odd attention layer keeps
    # `self.sliding_window = None` and its decoder layer `is_sliding=False`: that full layer's causal mask is right (the
    # fix was called window-missing, each layer's config a source of its own)
    check_bug(tmp_path, "transformers_gemma2_fa2_sliding_layer_zeroes_padding_mask", "real-query-blind")


def test_megatron_interleaved_pattern_states_each_layers_kind(tmp_path):
    """NVIDIA-NeMo/Megatron-Bridge#5441 (written blind, batch blind-ci): `layer_number % sum(pattern) != 0` built the
    first of two global layers of (3, 2) with a window. The provider's interleaved_attn_pattern (local, global) says
    layer i (0-based) slides where i % (local + global) < local: layers 3 and 4 are full, and layer 3 is windowed."""
    flagged = check_bug(tmp_path, "megatron_bridge_gemma4_consecutive_global_layers_get_window", "window-on-full-layer")
    assert [f["message"].split(" is a ")[0] for f in flagged] == ["layer 3"], flagged
    assert flagged[0]["source"].startswith("interleaved_attn_pattern=(3, 2) (config (Gemma4ModelProvider) in main()")
    local, glob = 3, 2  # the reference: Megatron's fixed classifier, 1-based layer numbers
    kinds = ["sliding" if (n - 1) % (local + glob) < local else "full" for n in range(1, 6)]
    assert kinds == ["sliding", "sliding", "sliding", "full", "full"]


def test_a_flag_said_for_the_whole_program_is_its_encoders_not_the_decoders_beside_it():
    # SpeechBrain's AISHELL recipe (speechbrain#2606, written blind, batch blind-fx): hparams `causal: False` in the
    # recipe's dict, an encoder run both ways and a decoder whose self-attention is causal, as every decoder's is
    class Seq2Seq(torch.nn.Module):
        def __init__(self, encoder_causal):
            super().__init__()
            self.encoder = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([_Layer(None) if encoder_causal else _Full()])})
            self.decoder = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([_Layer(None)])})

        def forward(self, x):
            return self.decoder["layers"][0](self.encoder["layers"][0](x))

    hparams = {"num_attention_heads": 2, "causal": False}  # noqa: F841 - read from this frame by the trace
    assert _codes(Seq2Seq(encoder_causal=False)) == []
    # the encoder run causal against it is still the flag ignored
    assert _codes(Seq2Seq(encoder_causal=True)) == [("bidirectional-run-causal", "wrong")]


def test_global_layers_handed_the_mask_made_4d_with_the_window_up_front(tmp_path):
    """unslothai/unsloth#3034's fix (8e994f07fb) keeps this, written another way: a dict config's layer_types, the 2-D
    mask made 4-D with the model-wide window before the masks are split by kind, a helper that returns a 4-D mask as
    given, so the "full" mask built with window=None is the windowed one; right padding, SDPA with a bool keep mask.
    Layer 1 is flagged, against a double loop over absolute positions: the full layer's causal + padding sees a key
    its mask hides. The fix (both masks from the 2-D one) is quiet, and so is the same model, correct, left padded."""
    name = "global_layers_reuse_prewindowed_4d_mask_right_padded_sdpa"
    flagged = check_bug(tmp_path, name, "window-on-full-layer", WINDOWS)
    assert [f["message"].split(" is a ")[0] for f in flagged] == ["layer 1"], flagged
    assert flagged[0]["source"] == "layer_types[1] (self.config of Model (dict))", flagged
    lengths, t, window = (9, 6), 9, 3
    full = lambda b, q, k: k < lengths[b] and k <= q  # noqa: E731 - what layer_types[1] states
    given = lambda b, q, k: full(b, q, k) and q - k < window  # noqa: E731
    assert first((2, t, t), lambda b, q, k: full(b, q, k) and not given(b, q, k)) == (0, 3, 0)
    status, found, report = traced(tmp_path, "global_layers_own_4d_mask_left_padded_quiet", False, WINDOWS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_window_field_a_prefix_names_the_attentions_is_read_and_a_convolutions_strides_are_no_layer_kinds():
    """fields_of: `attn_sliding_window_size` / `attention_sliding_window` / `local_sliding_window` state the attention's
    window (as sliding_window_size, said by their own name); another part's (`vision_sliding_window_size`) is not read.
    A per-layer word in a convolution's field (`decoder_convs_strides`) says nothing of the attention layers' kinds;
    the same word alone (`stride`, a strided sparse attention's) still leaves them unknown."""
    from maskcli.checks.intent import Intent, Stated, fields_of

    for name in ("attn_sliding_window_size", "attention_sliding_window", "local_sliding_window"):
        fields = fields_of({name: 16, "n_heads": 4})
        assert fields["sliding_window_size"] == 16 and fields["window_field"] == name
        assert Intent([Stated("cfg", None, fields)]).said("sliding_window_size") == f"{name}=16 (cfg)"
    assert "sliding_window_size" not in fields_of({"vision_sliding_window_size": 16, "n_heads": 4})
    assert fields_of({"sliding_window": 8, "decoder_convs_strides": [1, 2, 2], "n_heads": 4})["other_layers"] is False
    assert fields_of({"sliding_window": 8, "stride": 2, "n_heads": 4})["other_layers"] is True


def test_transformer_xl_same_length_mask_one_key_past_mem_len_is_flagged_and_its_fix_is_not(tmp_path):
    """huggingface/transformers#15665 (written blind, blind-jd, round 60): TF Transformer-XL's `same_length` mask never
    read mem_len, so each query saw mem_len + 1 keys. same_length=True states the window: every query sees mem_len keys,
    itself the last (transformers' PyTorch model: triu(1 + mlen) + tril(-(qlen - (klen - mem_len))))."""
    hit = check_bug(tmp_path, "transformers_tf_transfo_xl_same_length_mask_ignores_mem_len", "window-off-by-one")[0]
    assert "sees window(9), one key wider than its config's window(8) (mem_len=8" in hit["message"].replace("\n", " ")


def test_a_transformer_xl_same_length_mask_is_a_window_of_mem_len_against_a_loop():
    """PyTorch Transformer-XL's dec_attn_mask (True = hidden), built as transformers built it, is window(mem_len) at
    every memory length: a loop over the query's absolute position and the keys it keeps counts mem_len or fewer, and
    the last kept key is its own."""
    for qlen, mlen, mem_len in ((6, 8, 8), (4, 0, 8), (5, 3, 4), (3, 9, 4)):
        klen = qlen + mlen
        ones = torch.ones(qlen, klen, dtype=torch.bool)
        mask_len = klen - mem_len
        shift = qlen - mask_len if mask_len > 0 else qlen
        hidden = torch.triu(ones, 1 + mlen) | torch.tril(ones, -shift)
        for i in range(qlen):
            kept = [k for k in range(klen) if not hidden[i, k]]
            position = mlen + i
            assert kept == [k for k in range(klen) if position - mem_len < k <= position]


def test_vllm_group_spec_window_on_global_layers(tmp_path):
    """vllm-project/vllm#51756 (written blind, batch blind-gu): with the hybrid KV cache manager
    off, sliding and global layers shared one group whose merged spec kept the window, and FlashAttentionImpl preferred
    the step metadata's window over the layer's own: the global layer 1 slid over 4 keys. The program's `config =
    Config()` states layer_types; the step's FlashAttentionMetadata (sliding_window (3, 0)) and CommonAttentionMetadata
    carry fields of the same names: what the program did, not its statement (trace/configvars.py)."""
    found = check_bug(tmp_path, "vllm_group_spec_window_applied_to_global_layers", "window-on-full-layer")
    assert "layer 1 is a full-attention layer (layer_types[1], config (Config) in main()" in \
        " ".join(found[0]["message"].split())


def test_a_step_info_object_carrying_the_window_beside_a_config_dict(tmp_path):
    """Written another way: a serving loop's per-step `StepInfo(sliding_window=3, causal=True)` beside the
    `model_config` dict at the program's top (layer_types: sliding, full); every layer masks with the step's window,
    so the full layer 1 slides. The fix masks with each layer's own window."""
    hit = caught(tmp_path, "engine_step_info_window_on_every_layer", ("window-on-full-layer",))
    assert "layer 1 is a full-attention layer (layer_types[1], model_config (dict)" in " ".join(hit["message"].split())


def test_llamacpp_iswa_base_cache_masks_global_layers_with_swa(tmp_path):
    """ggml-org/llama.cpp#15811 (written blind, batch blind-ko): the kq_mask asked the model-wide
    `hparams.is_masked_swa`, so the iSWA model's non-SWA cache slid its global layers too. llama_hparams states the
    window as `n_swa` (standard swa_type) and each layer's kind as `swa_layers` (checks/fieldnames.py): layer 2, whose
    swa_layers entry is False, slid over 4 keys. The fix passes each cache its own window."""
    found = check_bug(tmp_path, "llamacpp_iswa_base_cache_masks_global_layers_with_swa", "window-on-full-layer")
    assert "layer 2 is a full-attention layer (swa_layers, self.hp of llm_build_gemma3_iswa (llama_hparams))" in \
        " ".join(found[0]["message"].split())


def test_a_gguf_runner_hands_one_swa_mask_to_every_layer(tmp_path):
    """Written another way: a runner's `hparams` dict at the program's top with llama.cpp's names (n_swa 3, swa_type 1,
    swa_layers True, False, True, False), one kq mask built from n_swa handed to every layer of one loop: layer 1
    slides. The fix builds each layer's from its swa_layers entry."""
    hit = caught(tmp_path, "gguf_runner_swa_on_every_layer", ("window-on-full-layer",))
    assert "layer 1 is a full-attention layer (swa_layers, hparams (dict) at the top of" in " ".join(hit["message"].split())


def test_qwen2_mask_slides_though_use_sliding_window_is_false(tmp_path):
    """huggingface/transformers#38002 (fixed by #38045; written blind, batch blind-ld, caught before any rule was
    changed for it): Qwen2's 4-D mask added the sliding band whenever config.sliding_window was set, though
    use_sliding_window=False, as Qwen2 checkpoints ship: every layer hid the older tokens of a left-padded generate."""
    check_bug(tmp_path, "transformers_qwen2_mask_ignores_use_sliding_window_false", "window-on-full-layer")


def test_fms_gpt_oss_window_added_in_place_to_the_shared_mask(tmp_path):
    """foundation-model-stack c55e59e5 (written blind, batch blind-le): gpt-oss's sink attention added its sliding
    band into the one mask every layer shares (`mask += torch.tril(...)`, the caller's view), so the full layers slid
    too. Its scores join the sink column, then shift each row by its max before the softmax: the sink is followed
    through the shift (trace/scores.py), so the calls are read over their keys alone."""
    found = check_bug(tmp_path, "fms_gpt_oss_sinks_sliding_window_added_in_place_to_shared_mask", "window-on-full-layer")
    assert "layer 1 is a full-attention layer (layer_types[1], self.config of base_model (GptOssConfig))" in \
        " ".join(found[0]["message"].split())


def test_a_sliding_layer_fills_the_shared_bias_in_place_behind_sink_columns(tmp_path):
    """Written another way: a NamedTuple's layer_types, one causal bias handed to every layer, the sliding layers'
    `masked_fill_` on it, a per-head sink joined with torch.cat and the row max subtracted: the full layer 1 sees a
    window of 3. The fix fills a copy; its calls are (1, 2, 8, 8), the sink column left out."""
    hit = caught(tmp_path, "shared_mask_window_filled_in_place_with_sinks", ("window-on-full-layer",))
    assert "layer 1 is a full-attention layer (layer_types[1], cfg (Settings)" in " ".join(hit["message"].split())
    _, _, report = traced(tmp_path, "shared_mask_window_filled_in_place_with_sinks", True, ROWS)
    assert "(1,2,8,8)  causal" in report and "(1,2,8,9)" not in report, report


def test_a_config_written_as_class_attributes_states_them():
    """fields_of: a config of the program's own written `class ModelConfig: num_layers = 2; attention_types = (...)`
    states its layer count and its per-layer field (read nowhere here, so no layer's kind is guessed from
    sliding_window_size alone), as the same config set on the instance does; a transformers config's class defaults
    are not read so."""
    from maskcli.checks.intent import fields_of

    class ModelConfig:
        num_layers = 2
        attention_types = ("local_sliding", "global")
        sliding_window_size = 4

    held = ModelConfig()
    on_instance = type("Plain", (), {})()
    on_instance.num_layers, on_instance.attention_types, on_instance.sliding_window_size = 2, ("local_sliding", "global"), 4
    for config in (held, on_instance):
        fields = fields_of(config)
        assert fields["layers"] == 2 and fields["other_layers"] is True and fields["sliding_window_size"] == 4
        assert layer_kind(config, 0) is None and layer_kind(config, 1) is None
    held.num_layers = 3  # (the instance's value over its class's)
    assert fields_of(held)["layers"] == 3
    transformers = pytest.importorskip("transformers")
    assert fields_of(transformers.MistralConfig(num_hidden_layers=2, sliding_window=4))["other_layers"] is False


def test_a_config_that_names_gemma_2_states_its_layers_turns(tmp_path):
    """Lightning-AI/litgpt#1545 (d3bf8a4b; written blind, blind-nn, missed before round 83): CausalSelfAttention put
    Gemma 2's window on blocks 1, 3, ... (`block_idx % 2`) where Gemma 2 slides on 0, 2, .... Its config states a
    window (`sliding_window_size`) and names the family (`name="gemma-2-tiny"`), no layer pattern: Gemma 2's layers
    take turns, the first sliding (transformers' configuration_gemma2.py), read by checks/fieldnames.py. Written another
    way, a dict config with `model_type: "gemma2"` whose port windows every layer. Both fixes quiet; a config naming
    Gemma 1's 2B (`gemma-2b`) or T5Gemma states no such turns."""
    from maskcli.checks.fieldnames import other_names

    name = "litgpt_gemma2_sliding_window_on_odd_layers"
    status, found, report = traced(tmp_path, name, False, Path(__file__).parent / "data" / "blind")
    wrong = {(f["code"], f["message"].split(" is a ")[0]) for f in found if f["severity"] == "wrong"}
    assert status == 1 and wrong == {("window-missing", "layer 0"), ("window-on-full-layer", "layer 1")}, report
    status, found, report = traced(tmp_path, name, True, Path(__file__).parent / "data" / "blind")
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
    hits = check_bug(tmp_path, "gemma2_port_window_on_every_layer", "window-on-full-layer",
                     Path(__file__).parent / "data" / "windows")
    assert {h["message"].split(" is a ")[0] for h in hits} <= {"layer 1", "layer 3"} and "model_type='gemma2'" in hits[0]["message"]
    for named, said in (("gemma-2-9b", True), ("gemma2", True), ("gemma-2b", False), ("t5gemma2", False), ("gemma-3", False)):
        found = {"sliding_window": 4}
        other_names({"model_type": named}, found)
        assert (found.get("sliding_window_pattern") == 2) == said, named


def test_mlx_lm_gemma3_first_layer_mask_kept_for_every_layer(tmp_path):
    """ml-explore/mlx-lm#39 (465b107c, the gemma3_text half; written blind, blind-rl, caught before any rule changed
    for it): Gemma3Model wrote the chosen mask back into `mask` and its `is_sliding` flag was true of the global
    layers, so layer 0 took the full causal mask and every later layer kept it: the five sliding layers of a cached
    prefill saw the whole prompt. The fix gives each layer its own mask; the sliding layers then see window(9) against
    the config's 8, mlx-lm's own later off-by-one (mlx-lm#390): true of the fix too."""
    name = "mlx_lm_gemma3_first_layer_mask_kept_for_all_layers"
    status, found, report = traced(tmp_path, name, False)
    missing = [f for f in found if f["code"] == "window-missing"]
    assert status == 1 and len(missing) == 5, report  # (layers 0-4 sliding, layer 5 global: sliding_window_pattern=6)
    assert "layer 0 is a sliding layer (sliding_window_pattern=6) but its mask is causal" in missing[0]["message"]
    status, found, report = traced(tmp_path, name, True)
    assert not [f for f in found if f["code"] == "window-missing"], report
    assert {f["code"] for f in found if f["severity"] == "wrong"} == {"window-off-by-one"}, report
