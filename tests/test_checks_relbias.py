"""checks/relbias.py (and trace/posbias.py): a site's relative-position bias at a cached step against its full pass."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import maskcli
from checkbugs import check_bug
from maskcli.checks.registry import severity

RELBIAS = Path(__file__).parent / "data" / "relbias"
BLIND = Path(__file__).parent / "data" / "blind"

BUGS = [
    # TransformerLensOrg/TransformerLens#777 (commit d9792a9, blind-dc): AbstractAttention.forward slices ALiBi as
    # alibi[:, :query_ctx, :key_ctx], so a cached decode step at position p gets row 0 (no distance bias) for row p
    ("transformerlens_alibi_bias_rows_wrong_with_past_kv_cache", "position-bias-misplaced"),
    # lucidrains/x-transformers#103 (commits dcae403, cc107eb; blind-dp): RelativePositionBias numbers the queries
    # arange(i) over keys arange(j) that start with j - i Transformer-XL memories, so each query takes the T5 buckets
    # of a query mem_len tokens earlier
    ("x_transformers_rel_pos_bias_not_shifted_for_xl_mems", "position-bias-misplaced"),
]


@pytest.mark.parametrize("name, code", BUGS)
def test_each_bug_is_flagged_and_its_fix_is_not(tmp_path, name, code):
    check_bug(tmp_path, name, code)


def test_t5_buckets_placed_from_zero_at_a_cached_step_left_padded(tmp_path):
    """Written another way: T5's bucketed bias (an nn.Embedding, computed by the first layer, shared), added with the
    finfo.min padding mask in one tensor to a left-padded batch decoded through a tuple cache; compute_bias places the
    queries at arange(query_length), so the decode query reads the first row's buckets. Said once for both layers (the same slip at each); the fix quiet."""
    hits = check_bug(tmp_path, "t5_buckets_decoder_cache_context_from_zero_left_padded", "position-bias-misplaced",
                     RELBIAS)
    assert len(hits) == 1 and "its query at position 6 of 7 keys" in hits[0]["message"]


def test_alibi_chunked_prefill_queries_numbered_from_zero(tmp_path):
    """Written another way: ALiBi as -slope * |k - q| (MPT's slopes) over a right-padded batch prefilled in chunks of 4
    through a cache, the chunk's queries numbered arange(q_len). The reference, from ALiBi's definition (Press et al.):
    at the first chunk the bias at distance -3 is -3 * slope; at the second, the last query (position 7, numbered 3)
    takes -slope * |4 - 3| at key 4, less -slope * |7 - 3| at its own key."""
    hits = check_bug(tmp_path, "alibi_chunked_prefill_queries_from_zero", "position-bias-misplaced", RELBIAS)
    slope = 2 ** (-8 / 4)  # head 0 of 4
    full, given = -3 * slope, -slope * abs(4 - 3) + slope * abs(7 - 3)
    assert len(hits) == 1 and f"head 0: {full:g} at distance -3" in hits[0]["message"], hits
    assert f"it adds {given:g} there" in hits[0]["message"] and "queries at 4..7 of 8 keys" in hits[0]["message"]


def test_deep_training_baichuan_alibi_sliced_on_the_key_axis_at_decode(tmp_path):
    """ssbuild/deep_training 54a9d1b (written blind, blind-tx; missed before tuning: trace/posbias.py read no addend of
    one value for every key): `attention_mask[:, :, -seq_length:]` kept the last key column, so each cached decode step
    added a (heads, 1, 1) bias, the same to every key. The prefill states ALiBi (slope * (k - q)); the step adds 0 at
    every distance. The fix (the query axis sliced) quiet."""
    hits = check_bug(tmp_path, "deep_training_baichuan13b_decode_alibi_sliced_on_key_axis", "position-bias-misplaced",
                     BLIND)
    assert len(hits) == 1 and "(its query at position 12 of 13 keys) it adds 0 there" in " ".join(
        hits[0]["message"].split()), hits


def test_an_alibi_bias_cut_to_its_corner_cell_at_decode_adds_no_distance(tmp_path):
    """Written another way: the bias built (heads, L, L) with -inf past each query, SDPA-free eager scores, a cache of
    torch.cat; at decode `bias[:, -1:, -1:]` (the new query's own cell) is broadcast over the keys. The reference, from
    ALiBi's definition: head 0's slope is 2 ** (-8 / 4), its bias at distance -8 is -8 times that."""
    hits = check_bug(tmp_path, "alibi_decode_bias_cut_to_its_corner_cell", "position-bias-misplaced", RELBIAS)
    slope = 2 ** (-8 / 4)
    message = " ".join(hits[0]["message"].split())
    assert len(hits) == 1 and f"head 0: {-8 * slope:g} at distance -8" in message and "adds 0 there" in message, hits


def _alibi_program(rows_of_last: bool, bloom_style: bool):
    """A prefill of 5 tokens, then two cached decode steps, one head, slope 0.5; the bias as Bloom adds it (slope * k,
    one row for every query) or as TransformerLens does (slope * min(k - q, 0)), its rows the last queries' or the
    first's."""
    def program():
        torch.manual_seed(0)
        keys = torch.randn(1, 1, 0, 4)
        for q_len, k_len in ((5, 5), (1, 6), (1, 7)):
            q, keys = torch.randn(1, 1, q_len, 4), torch.cat([keys, torch.randn(1, 1, k_len - keys.shape[2], 4)], dim=2)
            position = torch.arange(k_len)
            if bloom_style:
                bias = 0.5 * position[None, :].float().expand(k_len, k_len)
            else:
                bias = 0.5 * (position[None, :] - position[:, None]).clamp(max=0).float()
            bias = bias[-q_len:] if rows_of_last else bias[:q_len]
            scores = q @ keys.transpose(-1, -2)
            scores = scores + bias
            causal = torch.ones(k_len, k_len, dtype=torch.bool).tril()[-q_len:]
            torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return program


def _found(program) -> list:
    with maskcli.trace() as t, torch.no_grad():
        program()
    return [(f.code, severity(f)) for group in t.groups() for f in group.findings if f.code == "position-bias-misplaced"]


@pytest.mark.parametrize("bloom_style", [False, True])
def test_the_rows_of_the_first_queries_at_a_decode_step_are_wrong_and_the_last_are_not(bloom_style):
    # Bloom's slope * k is TransformerLens's slope * min(k - q, 0) plus a constant per row: one bias to a softmax
    assert _found(_alibi_program(True, bloom_style)) == []
    if not bloom_style:  # (Bloom's one row for every query: the first rows are the last, nothing to get wrong)
        assert _found(_alibi_program(False, bloom_style)) == [("position-bias-misplaced", "wrong")]


def test_the_recorded_function_is_the_slope_times_the_distance():
    # the reference: ALiBi's -slope * |k - q| written from its definition (Press et al.), per distance
    def program():
        q, k = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
        slopes = torch.tensor([0.5, 0.25])[:, None, None]
        position = torch.arange(6)
        bias = slopes * (position[None, :] - position[:, None]).clamp(max=0)
        causal = torch.ones(6, 6, dtype=torch.bool).tril()
        torch.softmax((q @ k.transpose(-1, -2) + bias).masked_fill(~causal, float("-inf")), dim=-1)

    with maskcli.trace() as t, torch.no_grad():
        program()
    found = t.calls[0].details["position_bias"]
    middle = len(found["low"][0]) // 2
    for head, slope in enumerate((0.5, 0.25)):
        for d in range(-5, 1):
            assert math.isclose(found["low"][head][middle + d], -slope * abs(d), abs_tol=1e-6)
            assert math.isclose(found["high"][head][middle + d], -slope * abs(d), abs_tol=1e-6)
        assert found["low"][head][middle + 1] is None  # (later keys are masked: no cell at distance 1)


def test_a_bias_that_is_no_function_of_the_distance_states_nothing():
    # Swin's window bias over 2-D offsets (a 2 x 2 window read row-major): k - q alone does not say the offset, so the
    # full pass states no function, and a decode step of the same site whose bias differs is not read against it
    offsets = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]])
    table = torch.randn(3, 3)
    rel = offsets[None, :, :] - offsets[:, None, :] + 1
    swin = table[rel[..., 0], rel[..., 1]]

    def program():
        for bias in (swin, torch.zeros(1, 4)):
            q_len = bias.shape[0]
            causal = torch.ones(4, 4, dtype=torch.bool).tril()[-q_len:]
            scores = torch.randn(1, 1, q_len, 4) @ torch.randn(1, 1, 4, 4).transpose(-1, -2) + bias
            torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)

    assert _found(program) == []
    with maskcli.trace() as t, torch.no_grad():
        program()
    assert "low" in t.calls[0].details["position_bias"]  # (read, and found to be no function of k - q)


def test_keras_hub_falcon_alibi_built_over_the_steps_query_at_a_static_cache_step(tmp_path):
    """keras-team/keras-hub#2977 (written blind, blind-vc; missed before: the static cache's step sits at
    `cache_update_index`, not at its keys' end, so its bias was read against an unwritten slot): cached Falcon built its
    ALiBi over the step's one token, a (B, H, 1, 1) of 0 broadcast over the cache. The reference: ALiBi's slope of head
    0 for 8 heads, 2 ** -(2 ** -(log2(8) - 3)) = 0.5, so the prefill adds -0.5 * 4 at distance -4, the first
    distance a decode step misses by more than a quarter of the bias's span (at its third step)."""
    slope = 2 ** (-(2 ** -(math.log2(8) - 3)))
    hit = check_bug(tmp_path, "keras_hub_falcon_cached_decode_alibi_over_query_window", "position-bias-misplaced")[0]
    message = " ".join(hit["message"].split())
    assert f"(head 0: {-slope * 4:.4g} at distance -4" in message and "it adds 0 there" in message, hit
    assert "a bias built over the step's own tokens" in message, hit


def test_a_static_cache_alibi_bias_over_the_steps_own_tokens(tmp_path):
    """keras-hub#2977 written another way (tests/data/relbias): a static cache of 16 slots written at
    `cache_position`, ALiBi over the distances among the step's own tokens padded out to the buffer. The prefill (5
    queries over 16 slots) states the function; decode step 1 (its query at slot 5) adds 0 at distance -4, where head 0
    (slope 2 ** (-8 / 4)) adds -slope * 4."""
    slope = 2 ** (-8 / 4)
    hit = check_bug(tmp_path, "static_cache_alibi_bias_over_the_steps_own_tokens", "position-bias-misplaced",
                    RELBIAS)[0]
    message = " ".join(hit["message"].split())
    assert f"(head 0: {-slope * 4:.4g} at distance -4" in message and "(its query at position 5 of 16 keys)" in message
