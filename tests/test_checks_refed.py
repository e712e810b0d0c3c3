"""checks/refed.py: a cached step handed again the tokens its cache already holds (its ids begin with all of the call
before's and the site's keys grew by all of them, two steps in a row): the cache holds them twice."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

REFED = Path(__file__).parent / "data" / "refed"
CODE = "cache-fed-again"


def _cell(finding) -> tuple:
    return tuple(finding["cell"])


def test_infini_transformer_generate_refeeds_prompt(tmp_path):
    """lucidrains/infini-transformer-pytorch c42031f: generate() handed the 6-token prompt back at every step while the
    kv cache kept growing (6, 12, 18... keys): step 1's queries (the prompt again) see the cached prompt (keys 0-5)
    and themselves again (keys 6-11). The fix feeds x[:, -1:] once a cache exists."""
    name = "infini_transformer_pytorch_generate_cached_kv_refeeds_prompt_rotary_restarts"
    found = check_bug(tmp_path, name, CODE)
    # step 1 (2, 6, 12): keys 0-5 are the prompt cached by the prefill, keys 6-11 the same prompt fed again; query i
    # (token i of the prompt, at key 6 + i) sees key k (causal: k <= 6 + i). A cell is wrong where the key is the
    # cached copy of the query's own token, fed again.
    assert _cell(found[0]) == first((2, 6, 12), lambda b, q, k: k < 6 and k <= 6 + q and k == q)
    message = found[0]["message"]
    assert "begin with all 6 tokens the model call before it was handed" in message
    assert "the cache holds those tokens twice" in message and "(6 -> 12)" in message
    status, fixed, report = traced(tmp_path, name, True)
    assert status == 0 and not [f for f in fixed if f["severity"] in ("wrong", "suspicious")], report


def test_gpt_generate_refeeds_whole_sequence_left_padded(tmp_path):
    """Written another way: a nanoGPT-style model (dataclass config, SDPA, a finfo.min bias from the padding its cache
    object keeps) over 3 prompts of 7 left-padded by 2, 0 and 1; the loop hands the whole sequence so far at every
    step (7, 8, 9... tokens) while the cache keeps every key (7, 15, 24...)."""
    name = "gpt_cache_generate_refeeds_whole_sequence_left_padded"
    found = check_bug(tmp_path, name, CODE, REFED)
    pads = (2, 0, 1)
    # step 1 (3, 8, 15): keys 0-6 the prompt (pads first), keys 7-14 the prompt and the first sample fed again; query q
    # sits at key 7 + q and sees the real keys up to it; the first real query sees its token's cached copy at key q
    assert _cell(found[0]) == first(
        (3, 8, 15), lambda b, q, k: q >= pads[b] and pads[b] <= k < 7 and k == q)
    message = found[0]["message"]
    assert "input_ids of GPT" in message and "begin with all 7 tokens" in message and "(7 -> 15)" in message
    status, fixed, report = traced(tmp_path, name, True, REFED)
    assert status == 0 and not [f for f in fixed if f["severity"] in ("wrong", "suspicious")], report


def test_recomputed_loop_prefix_cache_and_repeated_token_are_quiet(tmp_path):
    """A loop with no cache over the whole sequence, one turn run three times over copies of one prefix cache, and a
    cached decode that feeds the same single token each step: the same ids again, none over a cache that kept them."""
    status, found, report = traced(tmp_path, "prefix_cache_reused_and_recomputed_generate_quiet", False, REFED)
    assert status == 0 and not [f for f in found if f["code"] == CODE], report
    assert not [f for f in found if f["severity"] in ("wrong", "suspicious")], report
