"""checks/restarted.py (fed by trace/handedshapes.py's shapes of each model call's tensors): a new batch's first
attention pass, from an emptied cache, shorter than an earlier batch's handed the same shapes."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

RESTARTED = Path(__file__).parent / "data" / "restarted"
ALLOWED = {"causal-lm-both-ways"}  # lag-llama#81's is_causal=False prefill, true of both runs (a separate bug)


def _cell(finding) -> tuple:
    return tuple(finding["cell"])


def test_lag_llama_reset_cache_leaves_y_cache(tmp_path):
    """lag-llama 5f0393d: reset_cache() cleared each block's kv_cache but set a nonexistent block.y_cache, leaving the
    model's y_cache True, so the second batch of series (handed (2, 46) as the first) fed only its last step: its
    first pass holds 1 token over 1 key where the first batch's held 32."""
    status, found, report = traced(tmp_path, "lag_llama_reset_cache_leaves_y_cache_next_batch_sees_one_step", False)
    assert status == 1, report
    found = [f for f in found if f["code"] == "restarted-from-tail" and f["severity"] == "wrong"]
    assert found, report
    # the fed step is the last row (31) of the 32-step pass, which (both ways, #81) sees keys 0-31: it misses 0-30
    assert _cell(found[0]) == first((2, 32, 32), lambda b, q, k: q == 31 and k < 31)
    assert "holds 1 token over 1 key" in found[0]["message"] and "ran 32" in found[0]["message"]
    assert "misses the 31 keys before the tail" in found[0]["message"]
    status, fixed, report = traced(tmp_path, "lag_llama_reset_cache_leaves_y_cache_next_batch_sees_one_step", True)
    # (its exit status is causal-lm-both-ways', true of the fix too; and the copied code predates 4a2d099 as well, so
    # its cached decode steps of batch 0 still rotate the query at position 0 over 32 keys: positions-vs-keys, true of
    # both runs, said of the decode group alone. Nothing else wrong or suspicious is said.)
    bad = [f for f in fixed if f["severity"] in ("wrong", "suspicious")]
    assert {f["code"] for f in bad} == ALLOWED | {"positions-vs-keys"}, report
    assert all("rotary table" in f["message"] for f in bad if f["code"] == "positions-vs-keys"), report


def test_generator_reset_keeps_warm_flag_left_padded(tmp_path):
    """Written another way: a token generator whose state dict keeps the cache and a warm flag, reset() emptying only
    the cache; three prompts of 7 left-padded by 2, 0 and 1, eager softmax behind a finfo.min bias, a cache that grows.
    The second batch's first pass holds its last token alone, where the first batch's ran 7."""
    name = "generator_reset_keeps_warm_flag_second_prompt_fed_last_token"
    found = check_bug(tmp_path, name, "restarted-from-tail", RESTARTED)
    pads = (2, 0, 1)
    # the last prompt row (6) of batch row 0 sees its real keys 2..6 causally: before the tail, keys 2..5
    assert _cell(found[0]) == first((3, 7, 7), lambda b, q, k: q == 6 and pads[b] <= k < 6)
    assert "misses the 4 keys before the tail" in found[0]["message"] and "ran 7" in found[0]["message"]
    status, fixed, report = traced(tmp_path, name, True, RESTARTED)
    assert status == 0 and not [f for f in fixed if f["severity"] in ("wrong", "suspicious")], report


def test_a_reference_attention_handed_in_is_another_call(tmp_path):
    """nanochat's model handed `attn=loop_attention` (each query run alone over its window, its first pass one query
    over one key) after the same ids ran its 16-token prefill: another argument, so not the same call. Quiet."""
    status, found, report = traced(tmp_path, "nanochat_sdpa_fallback_window_pattern_ssl_chunked_prefill_kvcache_decode",
                                   False, Path(__file__).parent / "data" / "quiet_blind")
    assert status == 0 and not [f for f in found if f["code"] == "restarted-from-tail"], report


def test_packed_segments_one_pass_each_is_the_datas_length(tmp_path):
    """A packed LM runs one causal SDPA pass per sequence its cu_seqlens cut (a THD varlen kernel's stand-in); the
    second batch of the same shape is cut 10/8/6 where the first was 13/7/4, so its first pass is shorter. Several
    fresh passes of a site in one call are segments of the data, not a restart: quiet (NeMo#14437's fix, written
    blind, said restarted-from-tail of the same shape before)."""
    status, found, report = traced(tmp_path, "packed_segments_one_pass_each_lengths_vary", False, RESTARTED)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report
