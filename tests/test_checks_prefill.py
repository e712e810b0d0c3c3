"""checks/prefill.py: a prompt prefilled in chunks, put together, against one pass over it; on reproductions of
published bugs, on transformers' own generate(prefill_chunk_size=...), and against cells worked out by a loop."""

from __future__ import annotations

import json

import pytest

from checkbugs import check_bug, runner, traced
from maskcli.commands import app

BUGS = [
    ("chunked_prefill_mask_dropped", "prefill-chunks-differ"),  # lablup/mlxcel#891: the continuation's mask dropped
    ("chunked_prefill_ring_overflow", "prefill-chunks-differ"),  # pytorch/executorch#20346: a chunk overflows the ring
    ("chunked_prefill_own_keys_only", "prefill-chunks-differ"),  # kekzl/imp#114: a chunk's own keys, not the cache's
    # QwenLM/Qwen#979 (written blind): causal_mask None unless query and key lengths agree, so several new tokens
    # over a KV cache see each other's future
    ("qwen_multitoken_kvcache_causal_mask_none", "prefill-chunks-differ"),
    # intel/ipex-llm PR #9968, commit 2e84575 (written blind, batch blind-dr; caught before any rule was changed for
    # it): over the fp8 KV cache the causal mask was built only when key_size == kv_seq_len, so a multi-token forward
    # on top of the cache ran with causal_mask=None
    ("ipex_llm_qwen_fp8_kv_cache_multitoken_no_causal_mask", "prefill-chunks-differ"),
    # sonos/torch-to-nnef#217 (written blind, blind-ap): the export's causal mask sized from the cache's batch axis, a
    # [1, 1] mask, so the prompt pass is bidirectional; the program checks it against token-by-token steps
    ("torch_to_nnef_llm_export_mask_sized_from_batch_dim", "one-pass-sees-later"),
    # panbanda/higgs#203 (written blind, blind-bx): the prefill's Causal mask variant dropped by the layers' match, the
    # prompt pass into the cache unmasked; `model.forward_trunk(tokens, cache)` is called directly, so the outermost
    # module calls are the blocks and the ids are the ones forward_trunk holds (checked against token-by-token steps)
    ("higgs_bonsai_prefill_causal_mask_variant_dropped", "one-pass-sees-later"),
]


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


def _first_difference(sees, expected, prompt: int) -> tuple[int, int]:
    return next((q, k) for q in range(prompt) for k in range(prompt) if sees(q, k) != expected(q, k))


def test_the_first_cell_is_where_the_chunks_part_from_one_pass(tmp_path):
    """mlxcel#891 with chunks of 4 over 12 tokens: a continuation chunk sees its whole chunk and the cache; one pass is
    causal. executorch#20346 with chunks of 8 into a cache of the last 8 keys, window 4: a query sees the keys still
    cached within its window. imp#114, chunks of 4: a query sees its own chunk's keys up to itself."""
    _, found, _ = traced(tmp_path, "chunked_prefill_mask_dropped", fixed=False)
    def dropped(q, k):
        return k <= q if q < 4 else k < (q // 4 + 1) * 4
    assert [f["cell"] for f in found if f["code"] == "prefill-chunks-differ"] == [[0, *_first_difference(dropped, lambda q, k: k <= q, 12)]]
    _, found, _ = traced(tmp_path, "chunked_prefill_ring_overflow", fixed=False)
    def overflowed(q, k):
        cached = range(q // 8 * 8, q // 8 * 8 + 8)  # after a chunk of 8 is written, the cache holds that chunk only
        return k in cached and q - 4 < k <= q
    [finding] = [f for f in found if f["code"] == "prefill-chunks-differ"]
    assert finding["expected"] == "window(4)"
    assert finding["cell"] == [0, *_first_difference(overflowed, lambda q, k: q - 4 < k <= q, 16)]
    _, found, _ = traced(tmp_path, "chunked_prefill_own_keys_only", fixed=False)
    def own(q, k):
        return k // 4 == q // 4 and k <= q
    [finding] = [f for f in found if f["code"] == "prefill-chunks-differ"]
    assert finding["expected"] == "causal" and finding["cell"] == [0, *_first_difference(own, lambda q, k: k <= q, 12)]


def test_a_chunked_prefill_aligned_top_left_is_said_once(tmp_path):
    """onnx#8068's chunks with is_causal: the decode-alignment rules say it; the chunks put together do not again."""
    status, found, report = traced(tmp_path, "chunked_prefill_is_causal", fixed=False)
    assert status == 1 and "prefill-chunks-differ" not in {f["code"] for f in found}, report


GENERATE = '''
import sys
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

def chunk_mask_dropped(module, query, key, value, attention_mask, **kwargs):
    if query.shape[2] != key.shape[2]:  # a continuation chunk: its mask dropped, and no is_causal either
        attention_mask = None
        kwargs["is_causal"] = False
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

AttentionInterface.register("dropped", chunk_mask_dropped)
AttentionMaskInterface.register("dropped", sdpa_mask)
attn = "dropped" if "--bug" in sys.argv else "sdpa"
small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, attn_implementation=attn)
torch.manual_seed(0)
for model in (MistralForCausalLM(MistralConfig(sliding_window=3, **small)), LlamaForCausalLM(LlamaConfig(**small))):
    model.eval()
    ids = torch.tensor([[0, 0, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    mask = torch.tensor([[0, 0] + [1] * 8, [1] * 10])
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, prefill_chunk_size=4, pad_token_id=0)
'''


def test_transformers_generate_in_prefill_chunks(tmp_path):
    """transformers' generate(prefill_chunk_size=4) on a left-padded batch, Mistral's sliding window (its cache keeps
    the last keys) and Llama's full layers: the chunks put together are one pass, and no finding says otherwise.
    An attention function that drops a continuation chunk's mask is told, against the config's window(3). (Before
    queries were read from generate's position_ids, steps.py's padding-lost took Mistral's sliding cache for
    positions and called this correct run wrong.)"""
    pytest.importorskip("transformers")
    script = tmp_path / "generate.py"
    script.write_text(GENERATE)
    for bug in ([], ["--bug"]):
        out = tmp_path / "t.json"
        result = runner.invoke(app, ["trace", "--json", str(out), str(script), *bug])
        found = [f for group in json.loads(out.read_text())["groups"] for f in group["findings"] if f["severity"] == "wrong"]
        if not bug:
            assert result.exit_code == 0 and found == [], result.output
        else:
            # the bool attention_mask the layer was handed and its kernel did not keep to (mask-argument-dropped: the
            # bug itself, which prefill-chunks-differ, against the config's window(3), said before the handed mask was
            # read); Llama's continuation chunks see the padding too, which padding-ignored says, from the
            # attention_mask: the same bug not told twice
            assert result.exit_code == 1 and "mask-argument-dropped" in {f["code"] for f in found}, result.output
            assert all(f["code"] != "prefill-chunks-differ" or f["expected"] == "window(3)" for f in found)
            assert "padding-ignored" in {f["code"] for f in found}


TREE = """
import torch
import torch.nn.functional as F

def attend(q, k, mask):
    return F.scaled_dot_product_attention(q, k, k, attn_mask=mask)

torch.manual_seed(0)
x = torch.randn(1, 2, 10, 8)
attend(x[:, :, :6], x[:, :, :6], torch.ones(6, 6, dtype=torch.bool).tril())  # prefill
parents = [-1, 0, 0, 1]  # a draft tree of 4 tokens after the 6 cached: 1 and 2 are siblings
tree = torch.eye(4, dtype=torch.bool)
for i, p in enumerate(parents):
    while p >= 0:
        tree[i, p], p = True, parents[p]
keys = x[:, :, :10]
mask = torch.cat([torch.ones(4, 6, dtype=torch.bool), tree], dim=1)
attend(x[:, :, 6:], keys, mask)  # verification
"""


def test_a_speculative_trees_verification_after_prefill_is_not_a_chunk_bug(tmp_path):
    """A draft tree verified behind the cache continues the prompt's positions, and its queries miss siblings inside
    their own block: that is the tree's mask, not a chunk that lost earlier keys. Every query still sees every cached
    key, which a dropped cache would not."""
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    out = tmp_path / "t.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
    found = [f for group in json.loads(out.read_text())["groups"] for f in group["findings"] if f["severity"] == "wrong"]
    assert result.exit_code == 0 and found == [], result.output
    script.write_text(TREE.replace("torch.ones(4, 6, dtype=torch.bool)", "torch.zeros(4, 6, dtype=torch.bool)"))
    result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
    found = [f for group in json.loads(out.read_text())["groups"] for f in group["findings"] if f["severity"] == "wrong"]
    assert result.exit_code == 1 and [(f["code"], f["cell"]) for f in found] == [("prefill-chunks-differ", [0, 6, 0])]


# a chunked prefill whose window over-attends: chunks see more keys than one pass would

def test_a_left_padded_chunked_prefill_whose_window_is_measured_from_the_chunks_start_is_found(tmp_path):
    from checkbugs import caught, first

    hit = caught(tmp_path, "chunked_prefill_window_from_chunk_start", ("prefill-chunks-differ",))
    real = [[0, 0] + [1] * 10, [1] * 12]
    w, chunk = 4, 4

    def chunked(b, q, k):  # what the program's chunks let query q see
        return real[b][k] and k <= q and (q // chunk) * chunk - k < w

    def one_pass(b, q, k):
        return real[b][k] and k <= q and q - k < w

    # real queries only; a query that sees more of its own chunk is not a chunking slip (prefill.py's _differ)
    expected = first((2, 12, 12), lambda b, q, k: real[b][q] and chunked(b, q, k) != one_pass(b, q, k)
                     and not (chunked(b, q, k) and k >= (q // chunk) * chunk))
    assert tuple(hit["cell"]) == expected


def test_a_plain_chunked_prefill_that_lets_every_query_see_the_caches_last_window_is_found(tmp_path):
    from checkbugs import caught, first

    hit = caught(tmp_path, "chunked_prefill_cache_window", ("window-lost", "prefill-chunks-differ"))
    w, chunk = 4, 6

    def seen(q, k):  # the program's mask of the chunk holding query q
        start = (q // chunk) * chunk
        return k <= q and (q - k < w or (start > 0 and k < start and start - k < w))

    expected = first((1, 18, 18), lambda b, q, k: q >= chunk and seen(q, k) and q - k >= w)
    assert hit["code"] == "window-lost" and tuple(hit["cell"]) == expected


CASCADE = '''
import torch
import torch.nn.functional as F

torch.manual_seed(0)


def attend(q, k, v, causal):
    """(out, lse) of one part of a cascade, as a flash kernel returns them (its causal over as many keys as queries)."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal), scores.logsumexp(-1)


prefix, new, dim = 8, 4, 16
keys, values = torch.randn(1, 2, prefix + new, dim), torch.randn(1, 2, prefix + new, dim)
q = torch.randn(1, 2, new, dim)
parts = []
for step in range(2):
    if step == 0:
        parts.append(attend(q, keys[:, :, prefix:], values[:, :, prefix:], causal=True))  # the new tokens
    else:
        parts.append(attend(q, keys[:, :, :prefix], values[:, :, :prefix], causal=False))  # the cached prefix
(o_new, lse_new), (o_prefix, lse_prefix) = parts
top = torch.maximum(lse_new, lse_prefix)
w_new, w_prefix = (lse_new - top).exp()[..., None], (lse_prefix - top).exp()[..., None]
merged = (o_new * w_new + o_prefix * w_prefix) / (w_new + w_prefix)
one_pass = F.scaled_dot_product_attention(
    q, keys, values, attn_mask=torch.ones(new, prefix + new, dtype=torch.bool).tril(prefix))
assert torch.allclose(merged, one_pass, atol=1e-5)
'''


def test_a_cascades_prefix_and_new_token_parts_are_no_chunks(tmp_path):
    """A prompt-cache hit attends its new tokens causally to themselves and the same queries again to the cached prefix
    with no mask, then merges the two by their log-sum-exp (LightLLM's, SGLang's cascade): one pass over prefix + new
    keys, which the program asserts. The prefix part continues the new tokens' positions with the keys grown by
    exactly their number, yet it is no later chunk of a prompt (the same query tensor again): quiet. The same helper
    handed each chunk of a prompt, the later chunk seeing every key, is a chunked prefill that sees later keys: found.
    (Not told apart where the scores are softmaxed by hand: a softmax's input records no query tensor.)"""
    script = tmp_path / "cascade.py"
    script.write_text(CASCADE)
    out = tmp_path / "c.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
    found = [f for group in json.loads(out.read_text())["groups"] for f in group["findings"] if f["severity"] == "wrong"]
    assert result.exit_code == 0 and found == [], result.output
    # two chunks of one prompt (4 then 8 keys behind a cache that keeps them), the second unmasked
    chunked = CASCADE.split("parts = []")[0] + (
        "for step in range(2):\n"
        "    attend(keys[:, :, 4 * step:4 * step + 4], keys[:, :, :4 * step + 4], values[:, :, :4 * step + 4], step == 0)\n")
    script.write_text(chunked)
    result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
    found = [f for group in json.loads(out.read_text())["groups"] for f in group["findings"] if f["severity"] == "wrong"]
    assert result.exit_code == 1 and [(f["code"], f["cell"]) for f in found] == [("prefill-chunks-differ", [0, 4, 5])], result.output


def test_lightllm_deepseek2_prompt_cache_prefix_merge_dropped_is_quiet(tmp_path):
    """LightLLM#893 (written blind, batch blind-r): the bug drops the merged result after attention, so buggy and fixed
    make the same attention calls, new tokens causal from one line and the cached prefix unmasked from another. Neither
    is a chunked prefill: both runs quiet (the bug is not in any mask; docs/checks.md, the blind split)."""
    from pathlib import Path

    blind = Path(__file__).parent / "data" / "blind"
    for fixed in (False, True):
        status, found, report = traced(tmp_path, "lightllm_deepseek2_prompt_cache_prefix_merge_dropped", fixed, blind)
        assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_open_lm_rectangular_mask_tril_in_padded_columns(tmp_path):
    """mlfoundations/open_lm#235: the rectangular mask's triangle written in the last q columns of a width padded to a
    multiple of 8, then cut to k: the cached 3-token step sees a later key (written blind, batch blind-y; caught before
    any rule was changed for it, by prefill-chunks-differ; the attention's own forward(is_causal=True), read since,
    says it more directly and the same cells are not told twice). Fix quiet."""
    found = check_bug(tmp_path, "open_lm_rectangular_mask_tril_in_padded_columns", "causal-flag-ignored")
    assert "query 4 sees later key 5" in found[0]["message"]


VERIFY = '''
import torch
import torch.nn.functional as F

torch.manual_seed(0)
HIDE = [[], [7, 8]]  # each batch row's rejected drafts of the first verify window, hidden at the second


def attend(x, cache, hide=None):
    cache.append(x)
    keys = torch.cat(cache, dim=2)
    n, total = x.shape[2], keys.shape[2]
    mask = (torch.arange(total - n, total)[:, None] >= torch.arange(total)[None]).repeat(x.shape[0], 1, 1)
    for b, keys_hidden in enumerate(hide or []):
        mask[b, :, keys_hidden] = False
    return F.scaled_dot_product_attention(x, keys, keys, attn_mask=mask[:, None])


cache = []
attend(torch.randn(2, 2, 6, 8), cache)  # the prompt
attend(torch.randn(2, 2, 3, 8), cache)  # verify window 1: drafts at 6-8
attend(torch.randn(2, 2, 3, 8), cache, HIDE)  # verify window 2 at 9-11
'''


def test_a_verify_window_that_hides_one_rows_rejected_drafts_is_no_chunk_bug(tmp_path):
    """mlxcel#163's fix: after a mixed-accept round the shared cache keeps every row's drafts, and the next verify
    window hides, in the row that accepted fewer, its rejected ones (keys 7-8 of batch row 1) while batch row 0 sees
    them: keys taken out of one row's cache on purpose, no chunk that lost earlier keys. The same keys hidden in every
    row is a chunk that lost them: found, at the first cell a loop over one causal pass finds."""
    from checkbugs import first

    script = tmp_path / "verify.py"
    out = tmp_path / "v.json"
    for hide, status in (("[[], [7, 8]]", 0), ("[[7, 8], [7, 8]]", 1)):
        script.write_text(VERIFY.replace("[[], [7, 8]]", hide))
        result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
        found = [f for group in json.loads(out.read_text())["groups"] for f in group["findings"] if f["severity"] == "wrong"]
        assert result.exit_code == status, result.output
        if status == 0:
            assert found == [], result.output
            continue
        hidden = eval(hide)
        expected = first((2, 12, 12), lambda b, q, k: (k <= q) != (k <= q and not (q >= 9 and k in hidden[b])))
        assert [(f["code"], tuple(f["cell"])) for f in found] == [("prefill-chunks-differ", expected)], result.output


def test_a_full_pass_checked_against_cached_steps_over_the_same_ids_is_found(tmp_path):
    """The same bug written another way (tests/data/repass/): a nanoGPT-style block whose hand-written softmax masks
    the future only on the cached path, a batch of two; the cached steps over the same ids say what each query sees.
    Every cell of the full pass that sees a later key is one, found at the first a loop finds; the fix is quiet."""
    from pathlib import Path

    from checkbugs import first

    folder = Path(__file__).parent / "data" / "repass"
    hits = check_bug(tmp_path, "gpt_cached_sampler_full_pass_bidirectional", "one-pass-sees-later", folder)
    assert tuple(hits[0]["cell"]) == first((2, 5, 5), lambda b, q, k: k > q)
    assert "in 5 steps" in hits[0]["message"] and "20 such cells" in hits[0]["message"]


def test_draft_tokens_verified_over_a_cache_with_is_causal_only_without_past_are_found(tmp_path):
    """ipex-llm PR #9968's slip written another way: SDPA's is_causal set only while there is no cache, so a batch of
    two verifying 4 draft tokens in one forward over its 6-token prompt runs them unmasked; the fix's mask is
    tril(diagonal=past_len). The first cell is where the unmasked verify rows part from one causal pass (a loop)."""
    from pathlib import Path

    folder = Path(__file__).parent / "data" / "prefillrows"
    found = check_bug(tmp_path, "spec_verify_draft_tokens_over_cache_is_causal_only_without_past",
                      "prefill-chunks-differ", folder)
    prompt, total = 6, 10
    sees = lambda q, k: k <= q if q < prompt else k < total  # noqa: E731 (the prompt causal, the drafts every key)
    assert [f["cell"] for f in found] == [[0, *_first_difference(sees, lambda q, k: k <= q, total)]]


def test_a_prompt_pass_of_a_decoder_run_by_a_plain_function_is_found(tmp_path):
    """Written another way (tests/data/repass/): no module is the model, a function runs the blocks over `input_ids`
    (the ids read off the frame that holds them), einsum scores and a hand-written softmax, a batch of two; the prompt
    prefilled into an empty cache unmasked. Every cell k > q of the 6-token prompt in both rows is one (a loop)."""
    from pathlib import Path

    from checkbugs import first

    folder = Path(__file__).parent / "data" / "repass"
    hits = check_bug(tmp_path, "functional_decoder_cached_prompt_unmasked", "one-pass-sees-later", folder)
    later = sum(1 for b in range(2) for q in range(6) for k in range(6) if k > q)
    assert tuple(hits[0]["cell"]) == first((2, 6, 6), lambda b, q, k: k > q)
    assert f"{later} such cells" in hits[0]["message"] and "in 6 steps" in hits[0]["message"], hits


VARLEN = """
import torch, torch.nn.functional as F
def varlen(q, cu_seqlens):
    return torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], q[:, :, s:e], q[:, :, s:e], is_causal=True)
                      for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())], 2)
print(varlen(torch.randn(1, 2, 6, 8), torch.tensor([0, 0, 3, 3, 6])).shape)
"""


def test_a_call_of_no_queries_between_chunks_is_no_chunk(tmp_path):
    """A varlen loop over cu_seqlens 0,0,3,3,6: two documents of 3 tokens, each causal (torch.tril's cells), with empty
    documents before each, attended as calls of 0 queries. A call of no queries neither starts nor continues a prompt's
    chunks: exit 0, two groups (the empty calls, the causal ones), no finding."""
    script = tmp_path / "varlen.py"
    script.write_text(VARLEN)
    out = tmp_path / "v.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(script)])
    assert result.exit_code == 0, result.output
    groups = json.loads(out.read_text())["groups"]
    assert [f for group in groups for f in group["findings"]] == []
    assert "empty: 0 queries, 0 keys" in result.output and "causal" in result.output


def test_returnn_causal_self_attention_chunk_sees_its_later_frames(tmp_path):
    """rwth-i6/returnn 324fa79 (written blind, batch blind-mq; caught before tuning, its fix flagged too): a chunk
    attended over its state joined with its frames gave every frame the whole joined length, so frame 0 of the second
    chunk saw the chunk's later frames. The fix's row 1, whose short first chunk packs its next frames before the
    call's key columns end, is no longer compared on the call's layout (its queries miss their own placed columns)."""
    hit = check_bug(tmp_path, "returnn_rf_causal_self_att_concat_state_no_causal_mask", "prefill-chunks-differ")[0]
    assert "query 5 of batch row 0 sees key 6, later than itself" in " ".join(hit["message"].split())


def test_chunks_whose_state_is_packed_per_row_are_quiet(tmp_path):
    """Written another way (tests/data/chunkstate): each chunk right-padded, the state kept per row and the next chunk's
    frames joined right after it, each frame seeing its own key count; the row with a short first chunk has its
    second chunk at columns 3..6, not at the call's last columns. Quiet, and every frame matches the whole sequence."""
    from pathlib import Path

    status, found, report = traced(tmp_path, "streamed_chunks_state_packed_per_row", False,
                                   Path(__file__).parent / "data" / "chunkstate")
    assert status == 0 and not [f for f in found if f["code"] == "prefill-chunks-differ"], report
    assert "every real frame matches the whole sequence at once" in report
