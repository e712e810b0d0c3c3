"""checks/causal_lm.py: a model named ...ForCausalLM whose prompt pass attends both ways, then decodes over its cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from checkbugs import caught, check_bug, first, traced

BUGS = [
    # unslothai/unsloth#2868: the SDPA fallback always called with is_causal=False, no mask
    ("unsloth_sdpa_fallback_is_causal_false", "causal-lm-both-ways"),
    # huggingface/transformers#30317: under "sdpa" an unpadded prompt's mask is None (meant for is_causal), and AWQ's
    # fused attention adds a mask only where one is given: an eager softmax that masks nowhere in the prompt pass
    ("awq_fused_attention_none_mask_from_sdpa", "causal-lm-both-ways"),
    # intel/ipex-llm#11767: with the compressed (SnapKV) cache the lookup step's 4 candidates are attended with
    # attention_mask = None behind 8 compressed keys (and layer 1's prompt pass, after a compressor's softmax at the
    # same module, with none either)
    ("ipex_llm_compresskv_lookup_step_drops_causal_mask", "causal-lm-both-ways"),
]


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


def test_a_left_padded_prompt_handed_the_padding_mask_alone(tmp_path):
    """Written otherwise: SDPA given the padding mask as attn_mask (so no is_causal) on a left-padded batch. Its first
    cell against torch.tril: the first real query that sees a real key tril hides."""
    hit = caught(tmp_path, "causal_lm_padding_mask_only", ("causal-lm-both-ways",))
    real = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=bool)
    tril = torch.ones(5, 5, dtype=torch.bool).tril().numpy()
    assert tuple(hit["cell"]) == first((2, 5, 5), lambda b, q, k: real[b, q] and real[b, k] and not tril[q, k])


def test_an_unpadded_prompt_whose_mask_is_none_through_a_softmax_that_masks_nowhere(tmp_path):
    """Written otherwise: a GPT-NeoX-style ...ForCausalLM builds its mask only for a padded batch and its eager softmax
    adds one only where given, so the site masks nowhere (engine.py sets such sites apart); its keys grow one a step
    over the prompt's cache. Its first cell against torch.tril: the first query that sees a key tril hides."""
    hit = caught(tmp_path, "causal_lm_unpadded_prompt_mask_none_softmax", ("causal-lm-both-ways",))
    tril = torch.ones(5, 5, dtype=torch.bool).tril().numpy()
    assert tuple(hit["cell"]) == first((1, 5, 5), lambda b, q, k: not tril[q, k])


def test_doge_under_sdpas_is_causal_skip_in_its_own_process(tmp_path):
    """huggingface/transformers#48748: Doge merges the causal mask into its dt_states mask only where masking_utils
    returned one, and under SDPA's is_causal skip it returned None: the prompt pass attends both ways (transformers'
    own DogeForCausalLM). Its fix's decode-step mask is dt_states alone, all 1.0: a constant, not ones-added. Run in a
    process of its own, as maskcli trace runs a program: the buggy program patches transformers' modeling_doge, which
    would stay patched for the --fixed run in this process."""
    pytest.importorskip("transformers", reason="the program builds transformers' DogeForCausalLM (the hf extra)")
    program = Path(__file__).parent / "data" / "bugs" / "doge_sdpa_causal_skip_dynamic_mask.py"
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    for fixed in (False, True):
        out = tmp_path / f"doge{int(fixed)}.json"
        done = subprocess.run([sys.executable, "-m", "maskcli", "trace", "--json", str(out), str(program),
                               *(["--fixed"] if fixed else [])], capture_output=True, text=True, timeout=600, env=env)
        data = json.loads(out.read_text())
        wrong = [f["code"] for g in data["groups"] for f in g["findings"] if f["severity"] == "wrong"]
        assert data["exit_status"] == 0, done.stderr
        assert (done.returncode, wrong) == ((0, []) if fixed else (1, ["causal-lm-both-ways"])), done.stdout


# a site whose decode steps attend through a function the program names causal: that name states the layer causal,
# and a prompt pass of the same site that attends both ways contradicts it

def test_mlxcel_internlm3_prefill_maskless_bidirectional(tmp_path):
    """lablup/mlxcel#999: InternLM3's leaf hands the generator's mask, None, to an unmasked SDPA for the prompt, while
    its decode steps go through causal_attention() (written blind, batch blind-y; caught once the attending function's
    name was read as a statement). Fix quiet."""
    from checkbugs import check_bug

    found = check_bug(tmp_path, "mlxcel_internlm3_prefill_maskless_bidirectional", "causal-lm-both-ways")
    assert found[0]["message"].startswith("its decode steps attend through causal_attention()")
    assert tuple(found[0]["cell"]) == next((0, q, k) for q in range(6) for k in range(6) if k > q)


def test_a_prompt_unmasked_beside_a_decode_method_named_causal_is_found(tmp_path):
    """The same bug written otherwise: the kernels as methods of the layer (`_decode_causal`), a batch of two."""
    from checkbugs import caught

    hit = caught(tmp_path, "prefill_unmasked_beside_a_causal_decode_function", ("causal-lm-both-ways",))
    assert hit["message"].startswith("its decode steps attend through _decode_causal()")
    assert tuple(hit["cell"]) == next((0, q, k) for q in range(5) for k in range(5) if k > q)


# the attending module's own class name (`CausalSelfAttention`) states the layer causal as a function's name does

def test_lag_llama_kv_cache_first_step_attends_future(tmp_path):
    """time-series-foundation-models/lag-llama#81: with use_kv_cache the first (whole-context) forward ran
    is_causal=False, and the sliding cache's one-step decodes read what it wrote (written blind, batch blind-u; caught
    once the class name was read: the model call hands float features, no token ids). Fix quiet."""
    found = check_bug(tmp_path, "lag_llama_kv_cache_first_step_attends_future", "causal-lm-both-ways")
    assert found[0]["message"].startswith("its attention module's class CausalSelfAttention states the layer causal")
    tril = torch.ones(8, 8, dtype=torch.bool).tril().numpy()
    assert tuple(found[0]["cell"]) == first((2, 8, 8), lambda b, q, k: not tril[q, k])


def test_a_class_named_causal_attention_masked_only_while_training_is_found(tmp_path):
    """The same bug written otherwise: minGPT-style einsum scores and a hand-written softmax masked only `if
    self.training`, token ids, a growing cache; the site masks nowhere in eval, and the class name makes it attention."""
    hit = caught(tmp_path, "causal_attention_class_mask_only_while_training", ("causal-lm-both-ways",))
    assert hit["message"].startswith("its attention module's class CausalAttention states the layer causal")
    tril = torch.ones(6, 6, dtype=torch.bool).tril().numpy()
    assert tuple(hit["cell"]) == first((2, 6, 6), lambda b, q, k: not tril[q, k])


def test_class_name_reading():
    """CamelCase and snake_case class names that say causal are read; ones that say the opposite are not."""
    from maskcli.checks.causalname import causal_class

    named = [type(name, (torch.nn.Module,), {})() for name in (
        "CausalSelfAttention", "GPTCausalAttention", "causal_attention", "NonCausalAttention", "BidirectionalAttention",
        "CausalityAttention", "Attention")]
    assert [causal_class([module]) for module in named] == [
        "CausalSelfAttention", "GPTCausalAttention", "causal_attention", None, None, None, None]
    assert causal_class([]) is None


def test_a_verify_step_behind_the_cache_handed_the_padding_mask_alone(tmp_path):
    """Written another way than ipex-llm#11767: a hand-written LlamaForCausalLM verifies 3 draft tokens at once over a
    left-padded batch, its mask causal only where there is no cache, so the verify step gets the padding alone. The
    finding's cell against torch.tril laid bottom-right over the 8 keys: the first draft token sees the last one's key,
    which tril hides; the fix (tril at every step) is quiet."""
    folder = Path(__file__).parent / "data" / "causallm"
    name = "draft_verify_left_padded_padding_mask_only_behind_cache"
    status, found, report = traced(tmp_path, name, False, folder)
    assert status == 1, report
    [hit] = [f for f in found if f["code"] == "causal-lm-both-ways" and f["severity"] == "wrong"]
    tril = torch.ones(3, 8, dtype=torch.bool).tril(8 - 3).numpy()
    b, q, k = hit["cell"]
    assert not tril[q - (8 - 3), k] and tril[q - (8 - 3), q]
    status, found, report = traced(tmp_path, name, True, folder)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_video_frames_attended_both_ways_not_a_causal_prompt(tmp_path):
    """A causal video generator (class CausalFrameAttention) whose config states 4 tokens a frame, decoding one whole
    frame a step over its cache: each frame attends both ways on purpose, so its first pass is no causal layer's
    prompt run both ways (quiet); the same model's over-wide cache (its buggy run) is framebudget's."""
    folder = Path(__file__).parent / "data" / "framebudget"
    for fixed in (False, True):
        status, found, report = traced(tmp_path, "causvid_rolling_cache_keeps_sink_plus_local_frames", fixed, folder)
        assert not [f for f in found if f["code"] == "causal-lm-both-ways"], report


def test_blocks_behind_a_cache_each_as_large_as_the_first_pass_are_quiet(tmp_path):
    """MemFlow's streaming video generator (written blind, blind-mq: its fix, and its buggy run for the same wrong
    reason, were said to run a causal layer's prompt both ways): every step is a block of frames as large as the first
    pass, attending itself both ways and every earlier block behind its cache; no config states a frame's size. Written
    another way (tests/data/causallm): a CausalSelfAttention over blocks of 6, its self-check a one-pass block-causal
    call at the same site. Quiet, and every block matches that pass."""
    status, found, report = traced(tmp_path, "block_causal_generator_blocks_behind_a_cache_no_frame_size_said", False,
                                   Path(__file__).parent / "data" / "causallm")
    assert status == 0 and not [f for f in found if f["code"] == "causal-lm-both-ways"], report
    assert "every block matches one block-causal pass" in report


def test_a_layer_whose_forward_builds_its_triangle_only_where_it_has_no_cache(tmp_path):
    """alpa-projects/alpa#608 (7356392b; written blind, blind-nb, missed until round 80): OPTSelfAttention's forward
    builds `triu(full(-1e10), 1)` under `if attention_cache is None`, and its cached branch a bias over the cache's
    slots that hides only those not written yet, so the prompt run through the preallocated cache attends both ways.
    The forward's own branch for no cache states the layer causal (trace/cachebranch.py), and the prompt fills the
    static cache's first 9 of 32 slots. Written another way: a growing `torch.cat` cache, SDPA, the triangle a `tril`
    under `if layer_past is None`, every request started with an empty cache tuple. Both fixes are quiet."""
    hit = check_bug(tmp_path, "alpa_opt_serving_cached_prompt_bias_not_causal", "causal-lm-both-ways",
                    Path(__file__).parent / "data" / "blind")[0]
    assert "OPTSelfAttention.forward builds a causal mask (torch.triu at line 98" in hit["message"]
    assert "where attention_cache is None" in hit["source"]
    assert tuple(hit["cell"]) == first((1, 9, 9), lambda b, q, k: k > q)
    status, found, report = traced(tmp_path, "cached_prompt_pass_mask_only_in_uncached_branch", False,
                                   Path(__file__).parent / "data" / "causallm")
    hit = next(f for f in found if f["code"] == "causal-lm-both-ways")
    assert status == 1 and hit["severity"] == "wrong" and "where layer_past is None" in hit["message"], report
    assert tuple(hit["cell"]) == first((1, 7, 7), lambda b, q, k: k > q)
    status, found, report = traced(tmp_path, "cached_prompt_pass_mask_only_in_uncached_branch", True,
                                   Path(__file__).parent / "data" / "causallm")
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_the_branch_for_no_cache_is_read_only_where_a_parameter_named_like_a_cache_picks_it():
    """trace/cachebranch.py's reading of a forward's ifs: the triangle's branch and the parameter that picks it."""
    from maskcli.trace.cachebranch import _branches

    def forward(self, x, past_key_value=None, causal=True):  # noqa: ARG001 - read, not run
        if past_key_value is None:
            mask = torch.triu(torch.ones(3, 3), diagonal=1)
        else:
            mask = None
        if causal:
            mask = torch.tril(torch.ones(3, 3))
        if not past_key_value:
            other = torch.tril(x, -1)  # (not a causal triangle: below the diagonal only)
        return mask, other

    [(name, when_none, line, shown)] = _branches(forward.__code__)
    assert (name, when_none, shown) == ("past_key_value", True, "torch.triu")
    assert line == forward.__code__.co_firstlineno + 2


def test_a_prefix_lm_familys_prompt_both_ways_is_no_causal_layers(tmp_path):
    """ai-edge-torch's PaliGemma2 port after 45f18d2 (written blind, blind-al; its fix was said to run a causal
    layer's prompt both ways): `CausalSelfAttention` is the port's one attention class, and its config class is named
    PaliGemmaConfig, a prefix-LM whose image + prompt prefix attends both ways on purpose. Written another way
    (tests/data/causallm): a `CausalAttention` port whose config states model_type "paligemma" is quiet; the same port
    stating "llava" (a causal VLM) is found."""
    blind = Path(__file__).parent / "data" / "blind"
    status, found, report = traced(tmp_path, "ai_edge_torch_paligemma2_prefill_image_prefix_causal", True, blind)
    assert not [f for f in found if f["code"] == "causal-lm-both-ways"], report
    folder = Path(__file__).parent / "data" / "causallm"
    name = "vlm_port_prompt_both_ways_prefix_family_or_not"
    status, found, report = traced(tmp_path, name, False, folder)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
    status, found, report = traced(tmp_path, name, False, folder, ("--llava",))
    assert status == 1 and [f["code"] for f in found if f["severity"] == "wrong"] == ["causal-lm-both-ways"], report
