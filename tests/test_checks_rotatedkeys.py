"""checks/rotatedkeys.py: a cached step's query rotated like another key than the one its mask places it at."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, traced

HERE = Path(__file__).parent / "data" / "rotatedkeys"


def test_keras_hub_gpt_neox_query_rotated_at_position_zero(tmp_path):
    """keras-team/keras-hub#2870 (written blind, blind-wo; missed before): GPT-NeoX's cached decode rotated the new
    query with the rotary layer's default start_index=0 while the whole key cache was rotated at 0..L-1. The
    reference: the shorter prompt holds 3 tokens, so the first step runs at cache index 2 (its static-cache mask lets
    the query see keys 0..2), and its angles are key 0's. The fix (start_index=cache_update_index) quiet."""
    found = check_bug(tmp_path, "keras_hub_gpt_neox_cached_decode_query_rope_at_position_zero", "query-rotated-apart")
    message = " ".join(found[0]["message"].split())
    assert "batch row 0's query 0 was rotated like key 0 (its angles in every rotary pair are that key's)" in message
    own = int(message.split("places it at key ")[1].split(",")[0])
    assert own == 2 and found[0]["cell"] == [0, 0, 0, 2]
    # one finding a layer, not one a step: indexes 3..11 of the 12-token buffer are 9 steps, each rotated at 0
    assert len(found) == 2 and all(" ".join(f["message"].split()).endswith("(9 calls alike)") for f in found)


def test_keras_nlp_llama_query_rotated_at_position_zero(tmp_path):
    """keras-team/keras-hub#1544 (written blind, blind-oq; missed before): keras-nlp's LLaMA rotated query and key
    without start_index in its cached step, the key cache rotated again at 0..max_length-1. The fix quiet."""
    found = check_bug(tmp_path, "keras_nlp_llama_cached_decode_query_rope_at_position_zero", "query-rotated-apart")
    assert "was rotated like key 0" in " ".join(found[0]["message"].split())


def test_a_query_rotated_past_its_own_key_is_found(tmp_path):
    """Written another way: interleaved rotary pairs (GPT-J's 2d, 2d+1), the cache kept unrotated and rotated again by
    concatenation each step, the query rotated at the cache's length taken after its own key was added. The
    reference: the prompt holds 5 tokens, so the first step's query sees keys 0..5 and its own key is 5; its angles
    match no key (it sits at 6). The fix (the length before the append) quiet."""
    found = check_bug(tmp_path, "sincos_cache_rerotated_query_at_cache_length", "query-rotated-apart", HERE)
    message = " ".join(found[0]["message"].split())
    assert "query 0 was rotated at a position none of the call's 6 keys was rotated at, but its mask places it at " \
           "key 5" in message


def test_a_sink_cache_rerotated_at_its_slots_is_quiet(tmp_path):
    """Correct: StreamingLLM's position shift (the cache's keys rotated again at their slots, the query at its own),
    over a left-padded batch whose rows number their real tokens from their first."""
    status, found, report = traced(tmp_path, "quiet_sink_cache_rerotated_at_slots_left_padded", False, HERE)
    assert status == 0, report
    assert [f for f in found if f["severity"] != "note"] == [], report


def test_ring_attention_rotary_table_sized_by_the_heads_axis(tmp_path):
    """lucidrains/ring-attention-pytorch ea485d0 (written blind, blind-wb; missed before): the rotary table was asked for
    `q.shape[-2]` positions of a (b, n, h, d) layout, the heads (one), so its one row rotated all 12 tokens at position
    0 under a causal mask. The fix (`q.shape[-3]`) quiet."""
    found = check_bug(tmp_path, "ring_attention_pytorch_rotary_length_from_heads_axis", "rotated-at-one-position")
    assert "its 12 queries and keys, which its causal mask orders, were all rotated by one (cos, sin) row" in \
        " ".join(found[0]["message"].split())


def test_gpt_neox_cached_keys_rotated_with_the_new_tokens_one_row(tmp_path):
    """EleutherAI/gpt-neox c0986cfd (written blind, blind-we; missed before): the decode step built its rotary table
    from the new tokens' count (one) and applied it to the cached keys too, seq-first [sk, b, np, hn]. The reference:
    the longer prompt holds 10 tokens and the first step's cache 7 + 1 = 8 keys (the batch's shorter row sets the
    first step), then one more a step. The fix (the table over every position, sliced at the offset) quiet."""
    found = check_bug(tmp_path, "gpt_neox_rotary_kv_cache_decode_positions_restart_at_zero", "rotated-at-one-position")
    message = " ".join(found[0]["message"].split())
    assert "its 8 keys, its own sequence's (at 8 key counts of the run every key was so rotated" in message


def test_a_prefill_handed_the_decode_steps_one_row_is_found(tmp_path):
    """Written another way: a rotary module that hands back the row at `offset` for one token, called for the prompt
    too, HF's (b, h, n, d) layout, SDPA with is_causal. The fix (a row per token) quiet."""
    found = check_bug(tmp_path, "decode_slice_of_rotary_cache_used_for_prefill", "rotated-at-one-position", HERE)
    assert "its 6 queries and keys" in " ".join(found[0]["message"].split())


def test_mlx_lm_gemma3n_queries_rotated_after_the_cache_offset_advanced(tmp_path):
    """ml-explore/mlx-lm#1806, fixed by #1848 (written blind, blind-qa; missed then): BatchKVCache advanced its offset
    in place, so Gemma 3n rotated its queries at the offset past the keys it had just rotated and cached (L positions
    on; per row, over a left-padded batch). The reference: the prompt's 9 queries and 9 keys, two (cos, sin) tables a
    shift apart, found once a layer. The fix (the offset rebound) quiet."""
    found = check_bug(tmp_path, "mlx_lm_gemma3n_batch_cache_offset_advanced_in_place_before_query_rope",
                      "query-rotated-apart")
    assert len(found) == 2
    assert "its 9 queries and the keys of its own 9 tokens were rotated by two (cos, sin) tables" in \
        " ".join(found[0]["message"].split())


def test_queries_rotated_at_the_cache_length_after_the_append_are_found(tmp_path):
    """Written another way: HF's layout and rotate_half, the keys rotated at `past + arange(n)` and cached, the queries
    at the cache's length read after the append (the prompt's 6 queries 6 positions on, each step's one on). The fix
    (the length before the append) quiet."""
    found = check_bug(tmp_path, "queries_rotated_at_cache_length_after_append", "query-rotated-apart", HERE)
    assert "its 6 queries and the keys of its own 6 tokens" in " ".join(found[0]["message"].split())


def test_axial_rows_and_columns_rotations_are_quiet(tmp_path):
    """Correct: a 2-D axial rotary (half the width by a patch's row, half by its column, queries and keys alike): two
    tables whose angles differ token to token, not by one shift."""
    status, found, report = traced(tmp_path, "quiet_axial_rope_vit_rows_and_columns", False, HERE)
    assert status == 0, report
    assert [f for f in found if f["severity"] != "note"] == [], report
