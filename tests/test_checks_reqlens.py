"""checks/reqlens.py (and trace/reqlens.py): an engine's per-request attention against the key counts its own
metadata object states for each request."""

from __future__ import annotations

import re
from pathlib import Path

from checkbugs import check_bug, traced

REQLENS = Path(__file__).parent / "data" / "reqlens"
QUIET = Path(__file__).parent / "data" / "quiet"


def _said(flagged: list[dict]) -> list[tuple[int, int, int]]:
    """(request, keys the call has or its last query sees, keys stated) of each finding, read off its message."""
    found = []
    for f in flagged:
        request = int(re.search(r"request (\d+)", f["message"]).group(1))
        had = int(re.search(r"(?:handed|sees) (\d+) keys", f["message"]).group(1))
        stated = int(re.search(r"states (\d+)", f["message"]).group(1))
        found.append((request, had, stated))
    return found


def test_xllm_prefix_cache_prefill_misses_cached_prefix(tmp_path):
    """xLLM#2161: the prefix-cache hit's 3 new tokens attend only themselves; AttentionMetadata.kv_seq_lens states 11
    (its 8 cached tokens and the 3 new), request B's 5 keys are its own (quiet)."""
    flagged = check_bug(tmp_path, "xllm_npu_prefix_cache_prefill_misses_cached_prefix", "request-keys-differ")
    assert _said(flagged) == [(0, 3, 8 + 3)]
    assert "kv_seq_lens" in flagged[0]["source"]


def test_lightllm_fp8_verify_reads_per_token_lengths(tmp_path):
    """LightLLM#1338: the verify kernel is handed the expanded per-token b_seq_len ([5, 6, 7, 8, 9, 10]) where the
    state's per-request counts (cu_seqlens_k, b_att_seq_len) are the two requests' 7 and 10 tokens."""
    flagged = check_bug(tmp_path, "lightllm_fp8_fa3_mtp_verify_noncausal", "request-keys-differ")
    lens, mtp = [7, 10], 3
    per_token = [n - mtp + 1 + i for n in lens for i in range(mtp)]
    assert _said(flagged) == [(r, per_token[r], lens[r]) for r in range(len(lens))]  # (the kernel reads entries 0, 1)


def test_paged_fallback_gathers_whole_blocks(tmp_path):
    """Written another way (vLLM v1's FlashAttentionMetadata, `seq_lens` beside `query_start_loc`): a torch fallback
    that gathers every slot of a request's blocks of 4 sees the stale slots past seq_lens; each request's last query
    sees its blocks' every slot. Its fix cuts the keys to seqused_k: quiet."""
    flagged = check_bug(tmp_path, "paged_decode_gathers_whole_blocks", "request-keys-differ", REQLENS)
    steps = [([6, 3], [[3, 1], [5]]), ([7, 5], [[3, 1], [0, 6]])]  # (seq_lens, block tables) of the program's 2 steps
    expected = [(r, 4 * len(table), n) for seq_lens, tables in steps for r, (n, table) in enumerate(zip(seq_lens, tables))
                if 4 * len(table) != n]
    assert _said(flagged) == expected


def test_quiet_on_padded_blocks_a_rolling_window_and_per_token_lengths(tmp_path):
    """Whole blocks with the slots past seq_lens masked (and a request's first tokens at their start: not top-left),
    a rolling buffer of the layer's sliding_window keys, a verify state holding per-token lengths beside the
    per-request ones: no finding."""
    status, found, report = traced(tmp_path, "engine_request_lengths_padded_window_verify", False, QUIET)
    assert (status, [f for f in found if f["severity"] in ("wrong", "suspicious")]) == (0, []), report


def test_quiet_on_requests_prefilled_alone_with_heads_on_the_batch_axis(tmp_path):
    """Each request prefilled alone over a padded 64-slot buffer, its scores laid out (tokens, heads, keys) by an
    einsum and read as (heads, 1, q, k); the metadata states each request's first query at 0 (sglang-jax's native
    backend, written blind: top-left-mask read its prefills as decode steps of a 64-key cache)."""
    status, found, report = traced(tmp_path, "engine_per_request_prefill_qhk_scores_over_padded_pool", False, QUIET)
    assert (status, [f for f in found if f["severity"] in ("wrong", "suspicious")]) == (0, []), report


def test_a_window_field_that_is_no_window_keeps_no_request_quiet():
    """hunt 8: a metadata object's `sliding_window=nan` and `window_size=(-1, 'x')` were read as a stated window, so a
    request handed 3 of its 5 keys passed. A size above 0, or a layer kind other than full attention, is a window."""
    from maskcli.checks.reqlens import _a_window

    assert [_a_window(v) for v in (4, 4.0, (-1, 3), [0, 2])] == [True] * 4
    assert [_a_window(v) for v in (float("nan"), float("inf"), -1, 0, True, None, "wide", (-1, "x"))] == [False] * 8
    assert _a_window(["full_attention", "sliding_attention"], kinds=True)
    assert not _a_window(["full_attention"] * 2, kinds=True) and not _a_window(["sliding_attention"])


def test_a_cross_attention_is_not_held_against_the_requests_own_keys(tmp_path):
    """sglang#25045's fix (written blind, blind-hc; said before to hand each request's cross-attention other keys
    than its `cu_seqlens_k`): the FA3 backend's cross-attention attends each request's image keys
    (`encoder_lens_int32`) through the same kernel as its self-attention, told apart only by the RadixAttention layer
    handed to `forward_decode`, whose `is_cross_attention` says so. Written another way (tests/data/quiet): a
    module-less backend whose layer object states vLLM's `attn_type="encoder_decoder"`, a prefill and a decode step."""
    status, found, report = traced(tmp_path, "sglang_fa3_cross_attention_replay_encoder_lens_first_request_only", True,
                                   Path(__file__).parent / "data" / "blind")
    assert not [f for f in found if f["code"] == "request-keys-differ"], report
    status, found, report = traced(tmp_path, "engine_cross_attention_layer_handed_to_one_paged_kernel", False, QUIET)
    assert (status, [f for f in found if f["severity"] in ("wrong", "suspicious")]) == (0, []), report
