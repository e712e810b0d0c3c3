"""checks/steps.py: one call site across its steps, on reproductions of published bugs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkbugs import check_bug, first, runner, traced
from maskcli.commands import app

BUGS = [
    ("padding_mask_first_step_only", "padding-lost"),  # OpenNMT/OpenNMT-py#2532: the pad mask at the first step only
    # (thu-nics/C2C#19, decode_mask_sliced: padding-ignored says it, from the model call's attention_mask)
    ("decode_window_dropped", "window-lost"),  # pytorch/executorch#22285: every written slot visible at decode
    ("cached_mask_rows_top_left", "top-left-mask"),  # rasbt/LLMs-from-scratch#1048: mask[:Lq, :Lk] at decode
    # (is_causal with a cache, lucidrains/x-transformers#187 and onnx/onnx#8068: kernels.py's top-left-causal says it,
    # naming is_causal, not top-left-mask a second time: test_checks_kernels.py)
    ("cached_prefill_not_causal", "causal-lost"),  # Mikyx-1/TinyLLM#17: no causal mask once a cache is attached
    # Zefan-Cai/KVCache-Factory#49 (written blind, batch blind-ap): H2O's scoring mask causal only in its last window
    ("kvcache_factory_h2o_scoring_causal_mask_only_in_window", "causal-lost"),
    # TransformerLensOrg/TransformerLens#1617 (written blind, batch blind-aw): generate() merged the caller's
    # attention_mask into step 0's kwargs only, so every cached decode step of a left-padded prompt saw the pads
    ("transformerlens_bridge_generate_padding_mask_step0_only", "padding-lost"),
    # huggingface/parler-tts e51113f (written blind, batch blind-cw; caught before any rule was changed for it): the
    # prompt's padding merged into the decoder mask only while prompt_hidden_states is given, so cached steps drop it
    ("parler_tts_decoder_prompt_attention_mask_dropped_on_cached_steps", "padding-lost"),
    # intel/ipex-llm PR #10433, commit bd64488 (written blind, batch blind-dr; caught before any rule was changed for
    # it): the fp8 KV cache's decode path called sdp_fp8(q, k, v) without the attention mask, so a left-padded batch's
    # decode steps attend to the padded slots the prefill masked
    ("bigdl_llm_llama_fp8_kv_cache_decode_sdp_drops_padding_mask", "padding-lost"),
    # labmlai/annotated_deep_learning_paper_implementations 1f38b23 (written blind, batch blind-gv; caught before any
    # rule was changed for it): Transformer-XL's mask was the top-left corner of one tril, so a segment's queries never
    # saw the memory of the one before
    ("labml_transformer_xl_memory_keys_masked_by_top_left_tril", "top-left-mask"),
    # cumc-dbmi/cehrbert 8c98e10 (written blind, batch blind-ha; caught before any rule was changed for it): the cached
    # decode's look-ahead mask cut from the top-left corner of a rectangle, so each new token saw the first token alone
    ("cehrbert_gpt_inference_cached_decode_lookahead_mask_top_left", "top-left-mask"),
    # lightseekorg/tokenspeed#271 (written blind, batch blind-gw): a prefix-cache hit's extend ran its kernel non-causal
    # over a paged cache already holding the request's new keys: each new token saw the later ones of its request
    ("tokenspeed_mha_extend_with_kvcache_prefix_hit_not_causal", "causal-lost"),
    # NVIDIA/Megatron-LM 9ddbac6b (written blind, batch blind-kz; caught before any rule was changed for it): TE's
    # attention built with the causal mask type ran each KV-cache decode step top-left, so it saw the first key alone
    ("megatron_core_te_kv_cache_decode_causal_mask_type", "top-left-mask"),
]
STEPS = Path(__file__).parent / "data" / "caches"
PREFILLROWS = Path(__file__).parent / "data" / "prefillrows"
BLIND = Path(__file__).parent / "data" / "blind"


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


@pytest.mark.parametrize("name, folder, chunk", [
    # Anemll/Anemll#17 (written blind, batch blind-cr): every prefill chunk sliced mask rows [:batch_size] and
    # position ids arange(batch_size), while its keys went to the cache at current_pos (the chunk's start)
    ("anemll_chat_batch_prefill_causal_mask_rows_from_zero", None, 8),
    # the same slip written another way: a bool mask filled into the scores, two prompts, a cache of stale keys
    ("static_cache_chunk_mask_rows_from_zero", PREFILLROWS, 4),
])
def test_chunks_whose_mask_rows_restart_at_zero_beside_current_pos_are_flagged(tmp_path, name, folder, chunk):
    """The second chunk's first query sits at current_pos = the chunk size (the model call's own argument, where its
    keys are written), and sees key 0 only: causal would give it keys 0..chunk (a double loop's reading)."""
    found = check_bug(tmp_path, name, "top-left-mask", *(() if folder is None else (folder,)))
    first = found[0]
    assert tuple(first["cell"]) == (0, chunk, 1)
    assert f"query {chunk} sees keys 0..0 only, not the {chunk} keys before it" in first["message"]


HELPER = '''
import sys
import torch
import torch.nn.functional as F

def attention(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

def decoder(x, step):
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    mask = None if step == 1 and "--bug" in sys.argv else causal
    q = kv = x
    if step == 2:  # a decode step behind the cache: one query over the 6 keys and its own
        q, kv, mask = x[:, :, :1], torch.cat([x, x[:, :, :1]], dim=2), None
    return attention(q, kv, kv, mask)

torch.manual_seed(0)
x = torch.randn(1, 2, 6, 8)
for step in range(3):
    decoder(x, step)
    if step < 2:
        attention(x, x, x)  # an encoder's self-attention over the same length: full, as it should be
'''


def test_a_function_shared_by_a_causal_and_a_full_caller_is_two_call_sites(tmp_path):
    """One attention function, called by the decoder (causal) and the encoder (full), is two call sites: the encoder's
    full mask is not the decoder's causal lost. The decoder dropping its causal mask at its second call still is."""
    script = tmp_path / "shared.py"
    script.write_text(HELPER)
    for bug, status in (([], 0), (["--bug"], 1)):
        out = tmp_path / "t.json"
        result = runner.invoke(app, ["trace", "--json", str(out), str(script), *bug])
        found = [f for group in json.loads(out.read_text())["groups"] for f in group["findings"]]
        assert result.exit_code == status, result.output
        assert [f["code"] for f in found if f["severity"] == "wrong"] == (["causal-lost"] if bug else []), result.output


FLEX_LOOP = '''
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
torch.manual_seed(0)
q = k = v = torch.randn(1, 2, 128, 16)
def causal(b, h, qi, ki): return qi >= ki
def full(b, h, qi, ki): return qi >= 0
def sliding(b, h, qi, ki): return (qi >= ki) & (qi - ki < 32)
def prefix(b, h, qi, ki): return (qi >= ki) | (ki < 64)
for mod in (causal, full, sliding, prefix):  # attention-gym's examples, one line for all
    out = flex_attention(q, k, v, block_mask=create_block_mask(mod, None, None, 128, 128, device="cpu"))
'''


def test_block_masks_passed_through_one_line_in_a_loop_are_independent_calls(tmp_path):
    """Issue 37: four BlockMasks through one flex_attention line are not a prefill and its steps (no cache grows
    there): a causal one, then a full one, is no causal mask lost."""
    script = tmp_path / "loop.py"
    script.write_text(FLEX_LOOP)
    out = tmp_path / "t.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
    groups = json.loads(out.read_text())["groups"]
    assert result.exit_code == 0 and len(groups) == 4, result.output
    assert [f for g in groups for f in g["findings"] if f["severity"] in ("wrong", "suspicious")] == [], result.output


# the same bug written as other projects write it: a window the prefill has, gone at decode, on a left-padded batch
# (a window test that needs every query row to see a key fails on every left-padded batch: checks/real.py)

def test_a_window_lost_at_decode_is_found_in_a_hand_written_model_over_a_left_padded_batch(tmp_path):
    from checkbugs import caught, first

    hit = caught(tmp_path, "window_lost_left_padded_model", ("window-lost",))
    real = [[0, 0, 1, 1, 1, 1, 1], [1] * 7]  # decode step 1: the attention_mask over 7 keys, the query at 6
    expected = first((2, 1, 7), lambda b, q, k: real[b][k] == 1 and 6 - k >= 3)  # W = 3
    assert tuple(hit["cell"]) == (expected[0], 6, expected[2])


def test_a_window_lost_at_decode_is_found_in_a_plain_softmax_over_a_batch_padded_by_lengths(tmp_path):
    from checkbugs import caught, first

    hit = caught(tmp_path, "window_lost_left_padded_softmax", ("window-lost",))
    start = [7 - 3, 7 - 7]  # lengths 3, 7 left-padded to 7; decode step 1: 8 keys, the query at 7
    expected = first((2, 1, 8), lambda b, q, k: k >= start[b] and 7 - k >= 4)  # W = 4
    assert tuple(hit["cell"]) == (expected[0], 7, expected[2])


@pytest.mark.parametrize("name, code", [
    ("lalamo_dynamic_kv_cache_sliding_window_suffix_rows", "window-lost"),  # trymirai/lalamo#200: suffix-local rows
    ("flax_nnx_mha_decode_is_causal_key_zero", "top-left-mask"),  # google/flax#5591: a decode step sees key 0 only
    # tinygrad/tinygrad#15949 (blind, third batch): ONNX Attention's is_causal tril(0) over past + new keys
    ("tinygrad_onnx_attention_is_causal_ignores_past_len", "top-left-mask"),
    # onnx/onnx#7297 (blind-j): the reference Attention's tril over past + new keys, behind a softmax written by hand
    # (exp(x - max) / sum: trace/masks.exp_softmax)
    ("onnx_reference_attention_is_causal_ignores_past_key", "top-left-mask"),
])
def test_blind_reproductions_of_a_decode_step_that_loses_its_prefill_are_flagged(tmp_path, name, code):
    """Written blind; the first two caught before any rule was tuned for the blind split, the third (of the second
    blind batch) scored after the first round's tuning, by rules not written for it."""
    check_bug(tmp_path, name, code)


def test_a_static_cache_mask_padded_with_zeros_past_the_prompt_is_not_padding_lost():
    # Bloom hands its forward a 2-D attention_mask as wide as the static cache, 0 on the slots the decode steps write
    # later: those slots are no padding, and the decode steps that see the tokens written there lose nothing.
    pytest.importorskip("transformers")
    result = runner.invoke(app, ["model", "bloom", "--attn", "eager", "--cache", "static"])
    assert result.exit_code == 0, result.output
    assert "--pad left" in result.output and "padding-lost" not in result.output and "wrong" not in result.output


def test_a_blind_flex_reproduction_of_a_window_lost_at_decode_is_flagged_in_its_own_process(tmp_path):
    """NVIDIA-NeMo/Megatron-Bridge#5259, written blind (caught before any rule was tuned for it): a decode step's
    flex mask_mod compares the query's local index with the key's, so only key 0 is seen. Run in a process of its
    own, as maskcli trace runs a program: flex_attention's eager path compiles, and dynamo's guards on that program's
    __main__ would break the next program traced in this process."""
    import subprocess
    import sys
    from pathlib import Path

    program = Path(__file__).parent / "data" / "bugs" / "megatron_gemma2_flex_decode_query_offset.py"
    for fixed in (False, True):
        out = tmp_path / f"t{int(fixed)}.json"
        done = subprocess.run([sys.executable, "-m", "maskcli", "trace", "--json", str(out), str(program),
                               *(["--fixed"] if fixed else [])], capture_output=True, text=True, timeout=600)
        data = json.loads(out.read_text())
        wrong = [f["code"] for g in data["groups"] for f in g["findings"] if f["severity"] == "wrong"]
        assert data["exit_status"] == 0, done.stderr
        assert (done.returncode, "window-lost" in wrong) == ((0, False) if fixed else (1, True)), done.stderr
        assert not fixed or wrong == [], done.stderr


def test_vmlx_falconh1_prefill_mask_always_nil(tmp_path):
    """osaurus-ai/vmlx-swift#185 (written blind, caught before any rule was changed for it): FalconH1's
    createAttentionMask returned nil, so the multi-token step after the first ran with no causal mask. Fix quiet."""
    found = check_bug(tmp_path, "vmlx_swift_falconh1_prefill_mask_always_nil", "causal-lost")
    q, k = found[0]["cell"][1:]
    assert k > q  # a later key


def test_hyprstream_llama_cached_multitoken_tril0_mask(tmp_path):
    """hyprstream#1521: a cached multi-token forward masked with tril(0) on [q_len, kv_len], hiding the cached history
    (written blind, batch blind-m; caught before any rule was changed for it)."""
    check_bug(tmp_path, "hyprstream_llama_cached_multitoken_tril0_mask", "top-left-mask")


def test_almide_wasm_mha_core_causal_mask_ignores_cache_offset(tmp_path):
    """almide/almide#227: mha_core masks `j > i` with a KV cache, so a decode step's one query sees key 0 only, not the
    cached keys before it (written blind, batch blind-y; caught before any rule was changed for it). Fix quiet."""
    found = check_bug(tmp_path, "almide_wasm_mha_core_causal_mask_ignores_cache_offset", "top-left-mask")
    assert "keys 0..0 only" in found[0]["message"]


# a layer whose prefill runs through a child module and whose decode steps attend in the layer itself: one cache, two
# call sites (the prefill's keys are exactly those each first decode step finds before its own query)

def test_hnet_kvcache_decode_drops_sliding_window(tmp_path):
    """goombalab/hnet#20: CausalMHA hands its window to the prefill's FlashCausalCrossAttention (a child module) but
    not to flash_attn_with_kvcache at decode, called in CausalMHA itself: decode attends the whole cache (written
    blind, batch blind-y; caught once window-lost read a layer's prefill at its child module). Fix quiet."""
    found = check_bug(tmp_path, "hnet_kvcache_decode_drops_sliding_window", "window-lost")
    own = 6  # the first decode step's query: after the 6-token prompt
    assert found[0]["message"].startswith("step 0 of layers.0.mixer.inner_cross_attn is window(4), but at step 0 "
                                          f"query {own} of layers.0.mixer sees {own + 1} keys back")
    assert tuple(found[0]["cell"]) == (0, own, 0)


def test_a_window_lost_in_the_parent_module_over_a_left_padded_batch(tmp_path):
    """The same bug written otherwise: separate q, k, v, an additive mask, a left-padded batch; the decode step keeps
    the padding but not the window (window 3 keys back, 4 with the query's own)."""
    from checkbugs import caught, first

    hit = caught(tmp_path, "window_lost_in_the_parent_module", ("window-lost",))
    real = [[0, 0, 1, 1, 1, 1, 1], [1] * 7]  # decode step 0: 7 keys, the query at 6
    expected = first((2, 1, 7), lambda b, q, k: real[b][k] == 1 and 6 - k > 3)
    assert tuple(hit["cell"]) == (expected[0], 6, expected[2])



def test_a_prefix_padding_mask_given_at_prefill_only_is_lost_at_decode(tmp_path):
    """Written another way: a right-padded conditioning prefix before the tokens, a hand-kept (k, v) cache, SDPA handed
    the prefix's padding at prefill and no mask on the cached steps."""
    found = check_bug(tmp_path, "prefix_padding_mask_prefill_only_hand_cache", "padding-lost", folder=STEPS)
    assert found[0]["message"].startswith("at step 1 query 6 of batch row 1 sees key 3")


def test_a_decode_fast_path_that_drops_the_padding_mask_loses_the_padding(tmp_path):
    """ipex-llm PR #10433's slip written another way: a GPT-style fused qkv, a boolean padding mask of three
    left-padded prompts grown per step, SDPA's prompt pass masked and its `q_len == 1` fast path handed no mask."""
    found = check_bug(tmp_path, "gpt_sdpa_decode_fast_path_drops_key_padding_mask", "padding-lost", folder=STEPS)
    lengths, width = [7, 4, 2], 7  # the program's prompts, left-padded to 7
    pads = [(b, k) for b in range(len(lengths)) for k in range(width) if k < width - lengths[b]]
    b, k = pads[0]  # the first padded key of the first padded row, seen by the first decode query (at position 7)
    assert [tuple(f["cell"]) for f in found] == [(b, width + s, k) for s in range(3)]


def test_unsloth_fast_generate_decode_mask_last_column_only(tmp_path):
    """unslothai/unsloth#2216: _fast_prepare_inputs_for_generation keeps only the mask's last column, so the decode
    steps of a left-padded batch attend the pads the prefill hid (written blind, batch blind-ae; caught before any rule
    was changed for it). The fix is quiet."""
    pytest.importorskip("transformers")  # (its LlamaConfig)
    check_bug(tmp_path, "unsloth_fast_generate_decode_mask_last_column_only", "padding-lost")


def test_transformers_llava_cached_decode_extended_mask_appended_after_text_mask(tmp_path):
    """huggingface/transformers#29389: LLaVA's cached decode appends the extended mask after the text mask, so a decode
    step attends the merge padding the prefill hid (written blind, batch blind-aa; caught before any rule was changed
    for it). The fix is quiet."""
    check_bug(tmp_path, "transformers_llava_cached_decode_extended_mask_appended_after_text_mask", "padding-lost")


def test_layers_of_the_prompt_in_one_loop_over_a_static_buffer_are_not_decode_steps(tmp_path):
    """llama.cpp's kq_mask over a static KV buffer (ggml-org/llama.cpp#28318's fix, written blind, batch blind-br): every
    layer's softmax is one line in a loop, so the prompt's second layer is the site's second call; it shares the prompt's
    mask (causal over the written cells, the empty cells past them masked) and is no decode step placed after 11 keys.
    A decode step whose mask is built from its row number (j <= i) still is: its query sees cell 0 only."""
    folder = Path(__file__).parent / "data" / "staticbuf"
    name = "kv_buffer_layers_in_one_loop_decode_mask_by_row"
    status, found, report = traced(tmp_path, name, False, folder)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "top-left-mask"]
    assert hit["severity"] == "wrong" and "at step 3 " in hit["message"], report  # (the first decode step, not layer 1)
    status, found, report = traced(tmp_path, name, True, folder)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report
    status, found, report = traced(tmp_path, "llamacpp_gemma4_e4b_image_chunk_decoded_non_causal", True,
                                   folder.parent / "blind")
    assert status == 0 and "top-left-mask" not in [f["code"] for f in found], report


def test_a_decode_from_an_empty_buffer_after_training_passes_is_no_top_left_mask(tmp_path):
    """t5x's examples (written blind, quiet-r123a): the site's first calls are square training passes, then a decode
    loop fills a buffer of zeros from slot 0 (`arange(length) <= cur_index`): its first step sees key 0 alone, and the
    next sees keys 0 and 1 over the same buffer, so its query sits at slot 0. The same loop whose index is never written
    back sees slot 0 alone at every step: a top-left mask."""
    folder = Path(__file__).parent / "data" / "staticbuf"
    found = check_bug(tmp_path, "decoder_trained_then_decodes_into_zero_buffer_index_not_advanced", "top-left-mask",
                      folder)
    assert "query 7 sees keys 0..0 only" in found[0]["message"]


def _window_loop(cells, own, keys, queries):
    """The reference: W where every real query of every row and head sees exactly the W keys up to its own (from its
    row's first real key on) and some real query's first key is after its row's first real key; else None."""
    widths, cuts = set(), False
    rows, heads, q_len, _ = cells.shape
    for b in range(rows):
        start = next((k for k in range(keys.shape[1]) if keys[b, k]), 0)
        for h in range(heads):
            for q in range(q_len):
                if not queries[b, q]:
                    continue
                seen = [k for k in range(cells.shape[-1]) if cells[b, h, q, k]]
                if not seen or seen[-1] != own[q] or seen != list(range(seen[0], own[q] + 1)):
                    return None
                widths.add(len(seen))
                cuts |= seen[0] > start
    if not widths or not cuts:
        return None
    width = max(widths)
    for b in range(rows):
        start = next((k for k in range(keys.shape[1]) if keys[b, k]), 0)
        for h in range(heads):
            for q in range(q_len):
                if queries[b, q] and not cells[b, h, q, max(start, own[q] - width + 1)]:
                    return None
                if queries[b, q] and cells[b, h, q, :max(start, own[q] - width + 1)].any():
                    return None
    return width


def test_a_prefills_window_read_off_its_intervals_is_the_cells_own():
    """steps._window reads a stored mask of one interval a row off its starts and ends (no pass over the cells): the
    same width as from the cells and as a plain loop, on random bands, windows and left padding."""
    import numpy as np

    from maskcli import tracefile
    from maskcli.checks.real import Real
    from maskcli.checks.steps import _window

    rng = np.random.default_rng(3)
    for _ in range(300):
        rows, heads, length = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(2, 10))
        pads = rng.integers(0, length // 2 + 1, rows)
        width = int(rng.integers(1, length + 1))
        at = np.arange(length)
        starts = np.maximum(at[None, None, :] - width + 1, pads[:, None, None]) + (rng.random((rows, heads, length)) < 0.1)
        ends = at[None, None, :] + 1 - (rng.random((rows, heads, length)) < 0.05)
        stored = {"form": "intervals", "shape": [rows, heads, length, length], "planes": [rows, heads],
                  "starts": starts.reshape(rows * heads, length, 1), "ends": ends.reshape(rows * heads, length, 1)}
        cells = tracefile.dense(stored)
        keys = at[None, :] >= pads[:, None]
        real = Real(keys, keys.copy(), None)
        read = _window(cells, at, real, stored)
        assert read == _window(cells, at, real) == _window_loop(cells, at, keys, keys), (width, pads)


def test_a_repeat_of_a_sites_first_call_is_no_decode_step(tmp_path):
    """sinkhorn-transformer's sort net (written blind, tests/data/blind): its (buckets, 1 + buckets) scores, each bucket
    seeing its null key and the buckets before it, run once per forward with the same shape, mask and placing: the
    second forward is no decode step, so no top-left-mask, on the bug or its fix."""
    for fixed in (False, True):
        _, found, report = traced(tmp_path, "sinkhorn_transformer_causal_rotated_heads_padding_mask_not_rotated", fixed,
                                  folder=BLIND)
        assert not [f for f in found if f["code"] == "top-left-mask"], report


def test_opennmt_lm_prompt_fed_at_step0_without_future_mask(tmp_path):
    """OpenNMT/OpenNMT-py 628b4726 (written blind, batch blind-dh; caught before any rule was changed for it): the
    TransformerLMDecoder built its future mask only when step is None, so a 7-token prompt fed at step=0 (cached LM
    decoding) attends both ways, where the site's teacher-forced pass was causal. Fix quiet."""
    found = check_bug(tmp_path, "opennmt_transformer_lm_decoder_prompt_at_step0_no_future_mask", "causal-lost")
    assert tuple(found[0]["cell"]) == first((2, 7, 7), lambda b, q, k: k > q)  # unpadded prompts: the first later key


def test_a_prompt_cached_at_its_first_chunk_without_a_causal_mask(tmp_path):
    """The same slip written another way (tests/data/caches): a nanoGPT-style model with its own KV cache builds its
    causal mask only while no cache is attached (`if kv_cache is None`), so a left-padded batch of prompts fed in one
    chunk once the cache is attached sees later prompt tokens; the padding mask still reaches it. Fix quiet."""
    found = check_bug(tmp_path, "kv_cache_prompt_chunk_mask_only_without_cache", "causal-lost", folder=STEPS)
    pads = [2, 0]  # the prompts' left padding (the model call's attention_mask)
    assert tuple(found[0]["cell"]) == first((2, 6, 6), lambda b, q, k: k > q >= pads[b])


def test_a_chunk_whose_keys_are_its_own_then_the_cached_prefix_holds_the_padding(tmp_path):
    """pi0/pi05's denoise step written another way: a right-padded observation prefix cached once, then an action chunk
    over torch.cat([its own keys, the cached prefix's]) with the prefix's padding folded into the mask (SDPA, an
    additive finfo.min mask). The padding is held, at the columns after the chunk's own: quiet (padding-lost said it on
    OpenTau's pi05 fix, read with the cache first). The same chunk handed no prefix padding is still padding-lost, at
    the first padded key of row 0 (its prompt of 5), read as the rule places a cache."""
    status, found, report = traced(tmp_path, "action_chunk_keys_before_cached_prefix_sdpa", False, STEPS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    status, found, report = traced(tmp_path, "action_chunk_keys_before_cached_prefix_sdpa", False, STEPS, ("--lost",))
    lost = [f for f in found if f["code"] == "padding-lost"]
    assert status == 1 and lost, report
    lengths, width = [5, 9], 9  # the prompts, right-padded to 9; the chunk's 4 queries read at positions 9..12
    b, q, k = first((2, 4, width), lambda b, q, k: k >= lengths[b])
    assert tuple(lost[0]["cell"]) == (b, width + q, k)
    assert "the padding is lost behind the cache" in lost[0]["message"]


# A window the prefill has, gone at decode, where the decode kernel masks nothing: it gathers each request's keys out
# of a KV pool by index and scores one query per head against them with an einsum (trace/headquery.py reads it)

WINDOWS = Path(__file__).parent / "data" / "windows"


def test_sglang_gemma3_flashinfer_decode_without_the_sliding_wrapper(tmp_path):
    """sgl-project/sglang#4823 (written blind, batch blind-ft): Gemma3ForCausalLM lacked
    get_attention_sliding_window_size, so the flashinfer backend built one decode wrapper and a sliding layer's decode
    gathered the whole request (the prefill applied window_left per layer). Per request, its one query at position
    seq_len - 1 sees every key 0 .. seq_len - 1; the window (sliding_window=4, counting the query) keeps 4. Fix quiet."""
    lost = check_bug(tmp_path, "sglang_gemma3_flashinfer_decode_sliding_layers_see_full_cache", "window-lost")
    _, found, _ = traced(tmp_path, "sglang_gemma3_flashinfer_decode_sliding_layers_see_full_cache", False)
    assert {f["code"] for f in found if f["severity"] == "wrong"} >= {"window-missing", "window-lost", "window-dropped"}
    assert all("layer 0" in f["message"] for f in found if f["code"] == "window-missing")  # the sliding layer only
    assert not any("layers.1" in f.get("source", "") for f in found)  # the full layer sees every key: right
    # each decode call is one request: its query at the request's last position q, its keys 0 .. q, the first one
    # outside the window (q - k >= 4) key 0, by a double loop over absolute positions
    for hit in lost:
        b, q, k = hit["cell"]
        assert (b, q, k) == (0, q, first((1, q + 1, q + 1), lambda b_, q_, k_: q_ == q and q_ - k_ >= 4)[2])
    assert {tuple(hit["cell"])[1] for hit in lost} <= {6, 7, 8, 9, 10, 11}  # the decode positions: 6 .. 8, 9 .. 11
    assert all(hit["severity"] == "wrong" for hit in lost)


def test_a_paged_decode_over_block_tables_that_masks_the_padding_only(tmp_path):
    """The same bug written another way: a Mistral-style model (ModelArgs dataclass, every layer sliding) over a paged
    cache; prefill through SDPA with a bool window mask per request, decode batched: each request's keys gathered by
    its block table into a left-padded buffer, einsum("bhd,bnhd->bhn"), masked_fill of the padding only. Fix quiet."""
    lost = check_bug(tmp_path, "paged_decode_block_table_window_dropped_left_padded", "window-lost", WINDOWS)
    # decode step 1: requests of 8 and 11 keys left-padded to 11, the query at column 10; sliding_window = 5
    start = [11 - 8, 0]
    expected = first((2, 1, 11), lambda b, q, k: k >= start[b] and 10 - k >= 5)
    assert tuple(lost[0]["cell"]) == (expected[0], 10, expected[2])


def test_a_per_request_decode_that_gathers_its_window_stays_quiet(tmp_path):
    """Correct: per-request decode over a pool, keys (H, n, D), einsum("hd,hnd->hn"); sliding layers gather from
    seq_len - sliding_window on, full layers every key (a dict config with layer_types). Nothing to say."""
    status, found, report = traced(tmp_path, "per_request_decode_window_start_index_quiet", False, WINDOWS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert "(1,3,1,3)" in report and "(1,3,1,11)" in report  # the decode calls were read: 3 keys sliding, all full


def test_one_sequence_taken_out_of_a_left_padded_batch_is_not_held_to_another_rows_padding(tmp_path):
    """mlx-lm#738's fix (tests/data/blind, written blind, batch blind-gl): a left-padded batch of 2 prefilled and
    decoded, then the unpadded row's rotating cache extracted and decoded alone, a batch of 1 at the same call site.
    Which prefill row it was the call does not say: only a key every row padded is its padding, and none is, so no
    padding-lost (the row seeing key 0, which row 0 padded, was read as row 0 before)."""
    status, found, report = traced(tmp_path, "mlx_lm_batch_rotating_cache_extract_unpadded_keeps_empty_slots", True,
                                   BLIND)
    assert status == 0, report
    assert [f for f in found if f["code"] == "padding-lost"] == [], report
    assert "decode 3  (1,2,1,9)" in report, report


def test_a_request_extended_behind_a_cached_system_prompt_without_its_causal_part(tmp_path):
    """tokenspeed#271 written another way (tests/data/caches): a system prompt prefilled once, causal, then each request
    run as one extend behind that cached prefix with no mask (the causal part built only while no cache is attached):
    every new token sees the later tokens of its own request. The first request's extend continues the prefill (its
    keys grown by exactly its 4 tokens): a chunked prefill, prefill-chunks-differ's; the second's starts again behind
    the 6 cached keys: causal-lost, the query placed after them. The fix (bottom-right causal, checked against one pass
    over both) quiet."""
    status, found, report = traced(tmp_path, "prefix_cache_hit_extend_not_causal", False, STEPS)
    assert status == 1, report
    lost = [f for f in found if f["code"] == "causal-lost"]
    assert {tuple(f["cell"]) for f in lost} == {(0, 6, 7)} and len(lost) == 2  # (one per layer)
    assert all("3 queries behind 6 cached keys" in f["message"] for f in lost)
    assert [f["code"] for f in found if f["severity"] == "wrong" and f not in lost] == ["prefill-chunks-differ"]
    check_bug(tmp_path, "prefix_cache_hit_extend_not_causal", "causal-lost", folder=STEPS)


def test_a_batch_concatenated_then_filtered_is_not_held_to_its_last_prefills_rows(tmp_path):
    """TGI's CausalLMBatch (tests/data/quiet_blind, written blind, batch quiet-r67a) written another way
    (tests/data/caches): a running batch of 2 and a newly prefilled batch of 2 concatenated into 4 rows (re-left-padded),
    then filtered back to 2 rows with the padding no row needs cut out. The count of the second prefill comes back, but
    its rows and cache columns do not: row 1 is the second prefill's row 0, its keys shifted. Each step's mask is that
    step's own: no padding-lost (row 1 seeing key 0, which the prefill's row 1 padded, was read as a lost padding)."""
    status, found, report = traced(tmp_path, "server_batch_concatenated_then_filtered_left_padded_decode", False, STEPS)
    assert status == 0, report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert "(4,2,1,8)" in report and "(2,2,1,10)" in report, report  # (the steps after both regroupings were read)


def test_a_new_requests_chunk_over_reused_pages_is_placed_by_its_cache_seqlens(tmp_path):
    """exllamav2's dynamic generator (tests/data/quiet_blind, written blind, batch quiet-r68a) written another way
    (tests/data/caches): a CPU stand-in of flash_attn_with_kvcache, under inference_mode, its queries at `cache_seqlens
    + i`. A new request's first chunk of 2 tokens runs over pages that still hold the last request's keys: its queries
    sit at 0 and 1 (its cache_seqlens is 0), not at the end of the 8 slots, so its causal cells are no mask cut from the
    top-left corner behind a cache (top-left-mask was said before: the stand-in's `cache_seqlens`, an inference tensor,
    was not read)."""
    status, found, report = traced(tmp_path, "paged_kvcache_standin_new_request_chunk_over_reused_pages", False, STEPS)
    assert status == 0, report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert "(1,2,2,8)" in report.replace("\n", "").replace(" ", ""), report


def test_a_static_cache_read_through_a_softmax_places_its_steps_before_the_unwritten_slots(tmp_path):
    """google-deepmind/gemma's gm Attention over a static cache (`end_index % cache_size`), through the program's own
    softmax: no K and V are read, so a decode step's query is placed at the keys' end by guess, in the slots nothing
    wrote yet. Its window is read from the last key each query sees (its own): the correct program (quiet-r80a, written
    blind: window-lost said "query 11 sees 7 keys back" before) is quiet, and the same cache whose local layers drop
    the sliding mask at decode is flagged at the query's real slot, 7 (the 7-token prompt's first decode step)."""
    status, found, report = traced(tmp_path, "quiet_gemma_gm_sliding_mask_cache_positions_left_padded", False,
                                   Path(__file__).parent / "data" / "quiet_blind")
    assert status == 0 and "window-lost" not in [f["code"] for f in found], report
    folder = Path(__file__).parent / "data" / "staticbuf"
    name = "gemma_static_softmax_cache_window_dropped_at_decode"
    status, found, report = traced(tmp_path, name, False, folder)
    hits = [f for f in found if f["code"] == "window-lost"]
    assert status == 1 and hits and hits[0]["severity"] == "wrong", report
    assert tuple(hits[0]["cell"]) == (0, 7, 0) and "query 7 sees 8 keys back" in hits[0]["message"], report
    status, found, report = traced(tmp_path, name, True, folder)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_textbox_generate_runs_the_prefix_again_without_its_causal_mask(tmp_path):
    """RUCAIBox/TextBox c9fe8cb (written blind, blind-pu, caught after tuning): TransformerEncDec.generate feeds the
    whole generated prefix back through the decoder each step, with no cache and no self_attn_mask, where training
    called the same layers causal over a right-padded batch: the prefix's earlier tokens see its later ones. The
    expected cells come from a double loop: at a pass of n queries, query i sees key j > i."""
    found = check_bug(tmp_path, "textbox_transformer_encdec_generate_prefix_rerun_without_self_attn_mask", "causal-lost",
                      Path(__file__).parent / "data" / "blind")
    assert all(f["message"].startswith("step 0 of decoder.transformer_layers.") for f in found), found
    later = [(i, j) for i in range(2) for j in range(2) if j > i]
    assert any(tuple(f["cell"][1:]) == later[0] for f in found) and "runs the whole prefix again" in found[0]["message"]


def test_a_loop_that_drops_the_mask_it_trained_with_is_said_by_the_sites_causal_pass(tmp_path):
    """Written another way (tests/data/rerun): nn.TransformerEncoder trained one step with a causal mask, then decoded
    greedily by running its prefix again without the mask; its class names no decoder (loopcausal.py has no word that
    it decodes), so the site's own causal pass says it. The fix hands the mask each step: quiet."""
    found = check_bug(tmp_path, "tiny_lm_greedy_loop_drops_causal_mask", "causal-lost",
                      Path(__file__).parent / "data" / "rerun")
    assert {f["message"].split(" is causal")[0] for f in found} == {f"step 0 of blocks.layers.{n}.self_attn" for n in (0, 1)}


def test_a_prefix_run_again_is_three_passes_each_one_query_longer(monkeypatch):
    """rerun_passes against a loop written here: runs of 3+ self-attention passes, each one query longer than the one
    before, masked alike; a training pass, a cross-attention, a run of 2, or a run whose passes of several queries are
    causal in some and see later keys in others (lengths in turn through one line) is none."""
    from types import SimpleNamespace

    import maskcli.checks.rerun as rerun

    monkeypatch.setattr(rerun, "_sees_later", lambda call: call.later)

    def calls(lengths, crossing=(), causal=()):
        return [SimpleNamespace(shape=(1, 2, n, n), api="sdpa", where="attn", later=i not in causal,
                                details={"cross": {"cross": i in crossing, "by": "inputs", "source": "written here"}})
                for i, n in enumerate(lengths)]

    def reference(lengths, crossing=(), causal=()):
        found, start = set(), 0
        for n in range(1, len(lengths) + 1):
            if n == len(lengths) or n in crossing or lengths[n] != lengths[n - 1] + 1 or n - 1 in crossing:
                alike = {i not in causal for i in range(start, n) if lengths[i] >= 2}
                if n - start >= 3 and len(alike) == 1:
                    found |= set(range(start, n))
                start = n
        return found

    for lengths, crossing, causal in [([4, 1, 2, 3, 4, 5], (), (0,)), ([4, 1, 2, 1, 2], (), ()), ([8, 8, 8], (), ()),
                                      ([1, 2, 3, 1, 2, 3], (), ()), ([2, 3, 4, 5], (2,), ()), ([5, 6, 7], (), ()),
                                      ([2, 3, 4, 5, 6], (), (1, 3)), ([2, 3, 4, 5], (), (0, 1, 2, 3))]:
        got = rerun.rerun_passes(calls(lengths, crossing, causal))
        assert got == reference(lengths, crossing, causal), (lengths, crossing, causal)


def test_a_one_query_step_over_a_row_whose_stated_length_is_one_is_not_top_left(tmp_path):
    """ScalingIntelligence/hydragen's decomposition (written blind, quiet-r103a): the unique suffix is right padded and
    read while n < seq_len[z], one row z at a time; a row of length 1 keeps key 0 alone out of 9, as a top-left causal
    step at position 8 would. The lengths the program holds state that row's one key: no top-left-mask."""
    folder = Path(__file__).parent / "data" / "quiet_blind"
    status, found, report = traced(tmp_path, "quiet_hydragen_shared_prefix_lse_decomposition", False, folder)
    assert status == 0 and "top-left-mask" not in {f["code"] for f in found}, report


def test_autoawq_fused_cache_start_pos_kept_across_generate_calls(tmp_path):
    """casper-hansen/AutoAWQ#178 (df909e8; written blind, blind-qk, caught before any rule changed for it): each fused
    layer resets `start_pos` only when its cache would overflow, so a second generate's 9-token prompt is masked with
    `triu(-inf, start_pos + 1)` at start_pos 12, an empty mask: its query 0 sees later key 1, where the first prompt
    pass of the same site was causal."""
    hit = check_bug(tmp_path, "autoawq_fused_cache_start_pos_kept_across_generate_calls", "causal-lost")[0]
    assert tuple(hit["cell"]) == (0, 0, 1) and "step 0 of model.blocks.0 is causal" in hit["message"], hit


def test_a_chunk_the_program_asks_non_causal_loses_no_causality(tmp_path):
    # local attention in two passes a chunk, merged by log-sum-exp: its own chunk `attend(..., causal=True)`, the chunk
    # before it `attend(..., causal=False)` through the same helper (MoBA's varlen path, quiet-r114a, writes its gated
    # chunks so): the program's literal word at the call, not a prefill that lost its triangle
    folder = Path(__file__).parent / "data" / "chunkmerge"
    status, found, report = traced(tmp_path, "unpadded_chunks_own_causal_previous_full_merged_by_lse", False, folder)
    assert status == 0 and "causal-lost" not in {f["code"] for f in found}, report


def test_unsloth_granite_batched_decode_mask_built_and_never_added(tmp_path):
    """unslothai/unsloth#4100, 6d0f864369 item 3 (written blind, blind-tf, caught before any rule changed for it):
    Granite's fast decode built the 4-D mask and left its addition commented out, so a left-padded row's decode
    queries attended its pads. The fix hands SDPA the mask as bool. Prompts of 8 and 3 tokens, left-padded to 8: the
    first decode step (position 8) and the first pad key it sees, by a loop over the pads."""
    hit = check_bug(tmp_path, "unsloth_granite_batched_decode_mask_not_added", "padding-lost")[0]
    pads = [8 - 8, 8 - 3]
    b, _, k = first((2, 1, 9), lambda b, q, k: k < pads[b])
    assert tuple(hit["cell"]) == (b, 8, k) and "the padding is lost behind the cache" in hit["message"], hit
