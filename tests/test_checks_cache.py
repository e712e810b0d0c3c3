"""checks/cache.py: a static cache's unwritten slots, on reproductions of published bugs and on transformers' own
StaticCache under generate."""

from __future__ import annotations

import json
from pathlib import Path
import textwrap

import pytest
from typer.testing import CliRunner

from checkbugs import check_bug, traced
from maskcli.commands import app

runner = CliRunner()


def _findings(tmp_path, source: str) -> tuple[int, list, str]:
    """(exit status, findings, report) of `maskcli trace` on a program written to tmp_path."""
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(source))
    out = tmp_path / "program.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
    data = json.loads(out.read_text())
    assert data["exit_status"] == 0 and data["calls"], result.output
    return result.exit_code, [f for g in data["groups"] for f in g["findings"]], result.output


def test_static_cache_without_a_decode_mask(tmp_path):
    # onnxruntime/mobius#340, onnx/onnx#8068: a static cache's slots past input_pos hold no key yet
    check_bug(tmp_path, "static_cache_no_decode_mask", "unwritten-slot")


def test_hugging_face_static_cache_given_to_sdpa_with_no_mask(tmp_path):
    # huggingface/transformers#30400 (from #30317, fixed by #30437): the decode step attends a StaticCache's empty
    # slots; no cache_position reaches the model call, so the slots written are read off the cache itself
    pytest.importorskip("transformers")
    status, found, report = traced(tmp_path, "hf_static_cache_sdpa_no_mask", fixed=False)
    # the prefill's is_causal over 8 slots is top-left, which is right for queries at the cache's start: quiet
    assert status == 1 and [(f["code"], f["severity"]) for f in found] == [("unwritten-slot", "wrong")], report
    # the first decode step: query 3 (3 prompt tokens, then itself: slots 0-3 written) sees slots 4-7, empty
    assert found[0]["cell"] == [0, 3, 4] and "4 such cells" in found[0]["message"], report
    status, found, report = traced(tmp_path, "hf_static_cache_sdpa_no_mask", fixed=True)
    assert (status, found) == (0, []), report


def test_a_flax_cache_dicts_decode_mask_turned_round_is_found(tmp_path):
    # NVIDIA/TransformerEngine#119: TE/JAX masks are True = mask out, and the decode branch wrote Flax's keep-mask
    # expression `arange(length) <= cur_index`: each step sees the empty slots after its own and not the written ones
    found = check_bug(tmp_path, "transformer_engine_jax_decode_cache_mask_polarity", "unwritten-slot")
    assert [f["cell"] for f in found] == [[0, t, t + 1] for t in range(4)]  # step t's query at t; slots past t empty
    assert [f"{5 - t} such cells" in f["message"] for t, f in enumerate(found)] == [True] * 4
    assert "its cache dict's cache_index" in found[0]["message"]


def test_a_flax_style_cache_dict_whose_decode_step_has_no_mask_is_found(tmp_path):
    found = check_bug(tmp_path, "flax_cache_dict_decode_no_occupancy_mask", "unwritten-slot",
                      folder=Path(__file__).parent / "data" / "cache")
    # a prompt of 3, then decode steps at positions 3, 4, 5 over 8 slots: each sees the empty slots after its own
    assert [f["cell"] for f in found] == [[0, 3, 4]] and "4 such cells" in found[0]["message"]

FAMILIES = """
    import torch
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(0)
    common = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, pad_token_id=0, head_dim=8)
    models = [(LlamaForCausalLM, LlamaConfig(**common)),
              (MistralForCausalLM, MistralConfig(sliding_window=4, **common)),
              (Qwen2ForCausalLM, Qwen2Config(sliding_window=4, use_sliding_window=True, max_window_layers=1, **common)),
              (Gemma3ForCausalLM, Gemma3TextConfig(sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                                   **common))]
    # a left-padded batch longer than the window (the sliding layers full from the prefill on) and one shorter (their 4
    # slots past the prompt unwritten until the decode steps fill them, the full layers' 5 slots longer)
    for ids in (torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]]), torch.tensor([[0, 5], [8, 9]])):
        for cls, config in models:
            for attn in ("sdpa", "eager"):
                config._attn_implementation = attn
                cls(config).eval().generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=4, do_sample=False,
                                            cache_implementation="static", pad_token_id=0)
"""


def test_no_alarm_on_static_cache_generate_of_full_and_sliding_layers(tmp_path):
    """Llama, Mistral and Qwen2 (sliding layers), Gemma 3 (sliding and full): transformers' StaticCache hands a full
    layer all max_cache_len slots and a sliding one its window's (cache_utils.py StaticLayer.update 462-494,
    StaticSlidingWindowLayer.update 547-624), and its masks hide the empty ones: no finding beyond notes."""
    pytest.importorskip("transformers")
    status, found, report = _findings(tmp_path, FAMILIES)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


DROPPED = """
    import torch
    import transformers.models.{module}.modeling_{module} as modeling
    from transformers import {name}Config, {name}ForCausalLM
    torch.manual_seed(0)
    made = modeling.{builder}
    def no_decode_mask(*args, **kwargs):  # the bug: "one new token needs no mask"
        mask = made(*args, **kwargs)
        return None if kwargs["inputs_embeds"].shape[1] == 1 else mask
    modeling.{builder} = no_decode_mask
    config = {name}Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, pad_token_id=0, {extra})
    ids = torch.tensor([[1, 5, 6]])
    try:
        {name}ForCausalLM(config).eval().generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                                  cache_implementation="static", pad_token_id=0)
    finally:
        modeling.{builder} = made  # (the program runs in the test's process: the next test gets the real one)
"""


@pytest.mark.parametrize("name, builder, extra", [("Llama", "create_causal_mask", ""),
                                                  ("Mistral", "create_sliding_window_causal_mask", "sliding_window=8")])
def test_a_decode_step_that_attends_a_static_cache_s_empty_slots(tmp_path, name, builder, extra):
    """With no mask at decode SDPA lets the one query see every slot. A prompt of 3, 3 new tokens: the cache holds
    max_length = 6 slots (a full layer; the sliding one min(window 8, 6) = 6, cache_utils.py 540); at decode 1, query 3
    was just written to slot 3, slots 4-5 hold no key (StaticLayer.update 481: slots cumulative_length + i)."""
    pytest.importorskip("transformers")
    status, found, report = _findings(tmp_path, DROPPED.format(name=name, module=name.lower(), builder=builder,
                                                                extra=extra))
    assert status == 1, report
    cells = [f["cell"] for f in found if f["code"] == "unwritten-slot"]
    assert cells == [[0, 3, 4]], report  # decode 2 (query 4, slot 5 empty) shares decode 1's stored mask: one finding


@pytest.mark.parametrize("args", [(), ("--offsets",)])
def test_padding_query_rows_unmasked_whole_over_a_static_cache_are_quiet(tmp_path, args):
    """Written after tt-xla#2953's fix (tests/data/blind ttxla_llama_static_cache_prompt_length_attention_mask): a
    static cache over a left-padded batch, the padding mask as wide as the cache, and a padding query's empty row
    opened on every slot (transformers' no-NaN rows). Those rows see unwritten slots on purpose: no unwritten-slot,
    nor padding-unused on the padding it holds, nor sees-later (the queries sit at input_pos, not at the slots' end);
    handed the padding counts instead of the mask (--offsets), the same."""
    status, found, report = traced(tmp_path, "static_cache_left_padded_unmasked_pad_rows", False,
                                   Path(__file__).parent / "data" / "quiet", args)
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert status == 0, report


def test_vllm_ascend_draft_steps_attend_rejected_tokens(tmp_path):
    """vllm-project/vllm-ascend#14883: the drafter's later one-token steps reuse the verify step's seq_lens, each
    request's rejected drafts still counted: the query written at slot 11 (row 0) sees slots 12-14 (written blind,
    batch blind-cf). Its fix subtracts num_rejected."""
    found = check_bug(tmp_path, "vllm_ascend_draft_steps_attend_rejected_tokens", "unwritten-slot")
    assert tuple(found[0]["cell"]) == (0, 11, 12) and "slots 12-14" in found[0]["message"]


def test_a_speculative_loops_kv_len_not_brought_back_after_verify(tmp_path):
    """Written another way: one sequence, a cache arena written with index_copy_, an additive -inf mask built from
    kv_len, which the verify step advanced by 4 drafts of which 2 were accepted; the verify block itself (each draft
    sees the drafts before it) and the step after the stale slot is overwritten are quiet."""
    found = check_bug(tmp_path, "spec_decode_kv_len_not_rolled_back_after_verify", "unwritten-slot",
                      folder=Path(__file__).parent / "data" / "caches")
    assert [tuple(f["cell"]) for f in found] == [(0, 8, 9)] and "slot 9 past it" in found[0]["message"]


APPENDED = '''
import torch

CACHE, NEW = 12, 4  # an exported static graph: the whole cache buffer, then the step's own keys appended after it
k_cache, v_cache = torch.zeros(1, 2, CACHE, 8), torch.zeros(1, 2, CACHE, 8)


def step(x, input_pos, unwritten_seen=False):
    n = x.shape[2]
    keys = torch.cat([k_cache, x], dim=2)
    mask = torch.full((n, CACHE + n), float("-inf"))
    for i in range(n):
        p = int(input_pos[i])
        mask[i, :int(input_pos[0])] = 0.0  # the slots written by earlier steps
        mask[i, CACHE:CACHE + i + 1] = 0.0  # the step's own keys, causal
        if unwritten_seen:
            mask[i, p:CACHE] = 0.0  # slots no step wrote yet
    out = torch.nn.functional.scaled_dot_product_attention(x, keys, torch.cat([v_cache, x], dim=2), attn_mask=mask)
    k_cache[:, :, int(input_pos[0]):int(input_pos[0]) + n] = x
    v_cache[:, :, int(input_pos[0]):int(input_pos[0]) + n] = x
    return out


class Graph(torch.nn.Module):
    def forward(self, x, input_pos, unwritten_seen=False):
        return step(x, input_pos, unwritten_seen)


torch.manual_seed(0)
graph = Graph()
for start in (0, 4):
    graph(torch.randn(1, 2, NEW, 8), torch.arange(start, start + NEW), SEEN)
'''


@pytest.mark.parametrize("seen", [False, True])
def test_keys_appended_after_the_whole_cache_are_no_unwritten_slots(tmp_path, seen):
    """`cat([k_cache, k])` (ExecuTorch's static llama, pytorch/executorch#14411's runner, written blind in batch
    blind-cr): the step's own keys sit past the buffer's slots, each query sees its own there and never the slot at
    its position, so those columns are not read as slots; the slots between the written ones and them still are."""
    status, found, report = _findings(tmp_path, APPENDED.replace("SEEN", str(seen)))
    flagged = [f for f in found if f["code"] == "unwritten-slot"]
    if not seen:
        assert flagged == [] and status == 0, report
    else:  # each query sees its own slot: slot j is position j, and a double loop finds the first seen slot past the
        # step's positions 0..3 (query 0 sees slots 0..11 at step 0)
        expected = next((0, q, j) for q in range(4) for j in range(12) if j >= 4 and j >= q)
        assert flagged and tuple(flagged[0]["cell"]) == expected, report


def _static_decode(skip_prompt: bool, left_pad: int = 0) -> list:
    """Written otherwise (WhisperSpeech's S2A generate, collabora/WhisperSpeech 20bbb6c4, blind-kf round 61): a static
    K/V buffer of 16 slots, a 5-token prompt prefilled into slots 0-4 (where `skip_prompt`, only its first token is
    written, as WhisperSpeech's prefill ran the start column alone), then 3 decode steps each writing its slot and
    attending slots 0..its own through SDPA. `left_pad` zero tokens start row 1 (bias-free projections of a zero
    embedding: zero keys at the row's start, masked). The unwritten-slot findings' cells."""
    import torch
    import torch.nn.functional as F

    import maskcli

    torch.manual_seed(0)
    proj = torch.nn.Linear(8, 24, bias=False)
    prompt = torch.randn(2, 5, 8)
    prompt[1, :left_pad] = 0
    k_cache, v_cache = torch.zeros(2, 1, 16, 8), torch.zeros(2, 1, 16, 8)
    valid = torch.ones(2, 16, dtype=torch.bool)
    valid[1, :left_pad] = False
    with maskcli.trace() as t, torch.no_grad():
        q, k, v = proj(prompt).chunk(3, dim=-1)
        upto = 1 if skip_prompt else 5
        k_cache[:, 0, :upto], v_cache[:, 0, :upto] = k[:, :upto], v[:, :upto]
        x = prompt[:, -1:]
        for step in range(3):
            at = 5 + step
            q, k, v = proj(x).chunk(3, dim=-1)
            k_cache[:, 0, at:at + 1], v_cache[:, 0, at:at + 1] = k, v
            keep = (torch.arange(16) <= at)[None, None, None, :] & valid[:, None, None, :]
            x = F.scaled_dot_product_attention(q[:, None], k_cache, v_cache, attn_mask=keep)[:, 0]
    return [tuple(f.cell) for group in t.groups() for f in group.findings if f.code == "unwritten-slot"]


def test_a_decode_step_attending_slots_its_prefill_never_wrote():
    """Slots 1-4 hold nothing (zero K and V) after slot 0 does: the first decode step whose write is read (step 1, slot
    6; the site's first call has nothing to compare with) sees slot 1 first (row 0, its one query). Quiet where the
    prompt was written whole, and on a row's leading zero keys (left padding, masked)."""
    assert _static_decode(skip_prompt=True)[0] == (0, 0, 1)
    assert _static_decode(skip_prompt=False) == []
    assert _static_decode(skip_prompt=False, left_pad=2) == []


def test_whisperspeech_s2a_prompt_never_prefilled_is_flagged_and_its_fix_is_not(tmp_path):
    # collabora/WhisperSpeech 20bbb6c4 (written blind, blind-kf, round 61: missed before tuning): the prompted S2A
    # generate prefilled the start column alone, so every decode step attends the prompt's empty cache slots
    hit = check_bug(tmp_path, "whisperspeech_s2a_prompt_never_prefilled_into_kv_cache", "unwritten-slot")[0]
    assert "sees cache slot 1, which holds no key (its K and V are zero)" in hit["message"].replace("\n", " ")


def test_ring_buffer_slots_whose_input_pos_is_each_rows_rope_position_are_not_unwritten_slots(tmp_path):
    """JetStream's engine (tests/data/quiet_blind, written blind, batch quiet-r68a) written another way
    (tests/data/caches): decode slots share one ring buffer and one write pointer; the model call is handed `input_pos`,
    one RoPE position per slot (2 slots), and its one query per slot padded to 2 rows, so the positions are as many as
    the call's query rows. They are not the step's write positions (the tokens are (2, 1): one per row), so no slot
    past them is read as unwritten. Its reference run (each request alone, one call per layer in a loop, beside the
    prefill buckets `prefill_lengths = [4, 8]`) is two layers of one sequence, not two rows cut short (segments-cut).
    Both were said before; quiet now."""
    status, found, report = traced(tmp_path, "ring_buffer_slots_padded_query_per_row_positions", False,
                                   Path(__file__).parent / "data" / "caches")
    assert status == 0, report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert "(2,2,2,16)" in report.replace("\n", "").replace(" ", ""), report  # (the padded decode steps were read)


def test_moss_tts_local_transformer_static_cache_under_flash_attends_empty_slots(tmp_path):
    """OpenMOSS/MOSS-TTS#52 (written blind, batch blind-lp; caught before any rule was changed for it): the realtime
    local transformer decoded each frame's codebooks over a preallocated StaticCache, and under flash_attention_2 (no
    mask) every step also attended the cache's empty slots. The fix uses a DynamicCache there."""
    found = check_bug(tmp_path, "moss_tts_realtime_local_transformer_static_cache_flash_attends_empty_slots",
                      "unwritten-slot")
    assert "query 1 sees cache slot 2 of 8, which holds no key yet" in " ".join(found[0]["message"].split())


POOL = '''
import torch
import torch.nn.functional as F

PAGE, PAGES = 8, 4  # one pool of 4 pages of 8 slots that the requests share, each on pages of its own
k_pool, v_pool = torch.zeros(1, 2, PAGE * PAGES, 8), torch.zeros(1, 2, PAGE * PAGES, 8)
pages = {0: [0], 1: [2]}  # request 0 on page 0 (slots 0-7), request 1 on page 2 (slots 16-23)


def slot(request, position):
    return pages[request][position // PAGE] * PAGE + position % PAGE


class Layer(torch.nn.Module):
    def forward(self, x, input_pos, requests):
        rows, n = x.shape[0], x.shape[2]
        keep = torch.zeros(rows, 1, n, PAGE * PAGES, dtype=torch.bool)
        for row, request in enumerate(requests):
            for i in range(n):
                at = int(input_pos[row, i])
                k_pool[0, :, slot(request, at)] = x[row, :, i]
                v_pool[0, :, slot(request, at)] = x[row, :, i]
                for p in range(at + 1):  # the request's positions up to the query's, on its own pages
                    keep[row, 0, i, slot(request, p)] = True
        return F.scaled_dot_product_attention(x, k_pool.expand(rows, -1, -1, -1), v_pool.expand(rows, -1, -1, -1),
                                              attn_mask=keep)


torch.manual_seed(0)
layer = Layer()
layer(torch.randn(1, 2, 5, 8), torch.arange(5)[None], [0])  # request 0's prompt: slots 0-4
layer(torch.randn(1, 2, 6, 8), torch.arange(6)[None], [1])  # request 1's prompt: slots 16-21, at positions 0-5
for step in range(2):  # both decode together, each on its own pages
    layer(torch.randn(2, 2, 1, 8), torch.tensor([[5 + step], [6 + step]]), [0, 1])
'''


def test_a_pool_of_pages_the_requests_share_has_no_slot_past_the_positions_written(tmp_path):
    """attention-gym's PagedAttention (its fix, meta-pytorch/attention-gym#190, written blind in batch blind-ot: an
    unwritten-slot false alarm there) written another way: one buffer of pages, a request prefilled into page 2 at
    positions 0-5 sees slots 16-21, past the positions its call writes, yet they hold its keys. The decode steps'
    batch rows see no slot in common: a pool, whose slot j is no position j."""
    status, found, report = _findings(tmp_path, POOL)
    assert [f for f in found if f["code"] == "unwritten-slot"] == [] and status == 0, report
