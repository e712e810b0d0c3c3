"""checks/regrouped.py (trace/regrouped.py): queries or keys viewed out of their projection with heads before positions,
caught in the published bug's reproduction (tests/data/bugs) and in a program written another way (tests/data/regrouped),
quiet on the fixes and on the layouts that step whole tokens; the token each position holds against torch's own view."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

import maskcli
from checkbugs import check_bug, first, traced
from maskcli.checks.registry import severity
from maskcli.trace.regrouped import regrouped, swapped

REGROUPED = Path(__file__).parent / "data" / "regrouped"


def _held(message: str) -> list[tuple[int, int]]:
    """(token, first feature) of positions 0 and 1 as the finding states them."""
    return [(int(t), int(f)) for t, f in re.findall(r"position \d (?:is )?token (\d+) \(features (\d+)-", message)]


def _reference(batch: int, tokens: int, heads: int, dim: int) -> list[tuple[int, int]]:
    """(token, first feature) of positions 0 and 1 of head 0 of `x.view(B, H, L, D)` of a (B, L, H·D) tensor, read off
    torch's view of one whose values are their own (token, feature)."""
    width = heads * dim
    x = torch.arange(batch * tokens * width).view(batch, tokens, width)
    viewed = x.view(batch, heads, tokens, dim)
    return [(int(viewed[0, 0, i, 0]) // width, int(viewed[0, 0, i, 0]) % width) for i in range(2)]


def test_informers_probattention_viewing_queries_keys_and_values_to_heads_first_is_found(tmp_path):
    # zhouhaoyi/Informer2020 7f8b80c "fix dimension change error": ProbAttention's queries.view(B, H, L_Q, -1) of a
    # [B, L, H, D] tensor where .transpose(2, 1) was meant; decoder self-attention, ProbMask causal over 12 steps, 2 heads
    found = check_bug(tmp_path, "informer2020_probattention_view_scrambles_causal_probmask", "positions-regrouped")
    assert _held(found[0]["message"]) == _reference(2, 12, 2, 8)
    assert "6 of the 12 tokens" in found[0]["message"]


def test_a_gpt_viewing_its_projections_straight_to_heads_first_before_sdpa_is_found(tmp_path):
    # written otherwise: minGPT-style q/k/v Linear outputs viewed (B, nh, T, hs) from (B, T, C), SDPA with a causal and
    # left-padding bool mask
    found = check_bug(tmp_path, "gpt_sdpa_view_heads_before_positions", "positions-regrouped", folder=REGROUPED)
    assert _held(found[0]["message"]) == _reference(2, 8, 4, 8)
    assert "2 of the 8 tokens" in found[0]["message"]


def _codes(layout) -> list:
    """Findings of an SDPA call, causal, over the q, k, v `layout` makes of a (2, 6, 36) projection (3 heads of 4)."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(12, 36)
    with maskcli.trace() as t, torch.no_grad():
        q, k, v = layout(proj(torch.randn(2, 6, 12)))
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return [(f.code, severity(f)) for group in t.groups() for f in group.findings]


def test_layouts_that_step_whole_tokens_are_quiet_and_the_view_is_not():
    def fused(qkv):  # (B, L, 3, H, D) permuted: each position one token's row
        return qkv.view(2, 6, 3, 3, 4).permute(2, 0, 3, 1, 4).unbind(0)

    def sequence_first(qkv):  # (L, B·H, D) transposed, as nn.MultiheadAttention lays a (L, B, E) input
        first = qkv.transpose(0, 1).contiguous()  # (L, B, 3E): a buffer of rows (L·B, 3E)
        return [first[..., 12 * i:12 * (i + 1)].reshape(6, 6, 4).transpose(0, 1) for i in range(3)]

    def sliced(qkv):  # each part a slice of the fused rows, unflattened and transposed: one row a position
        return [qkv[..., 12 * i:12 * (i + 1)].unflatten(-1, (3, 4)).transpose(1, 2) for i in range(3)]

    def straight(qkv):  # the bug: each (B, L, H·D) part viewed (B, H, L, D)
        return [qkv[..., 12 * i:12 * (i + 1)].contiguous().view(2, 3, 6, 4) for i in range(3)]

    for quiet in (fused, sequence_first, sliced):
        assert not [c for c in _codes(quiet) if c[0] == "positions-regrouped"], quiet.__name__
    assert ("positions-regrouped", "wrong") in _codes(straight)


def test_the_positions_a_view_holds_match_torchs_own_view():
    proj = torch.nn.Linear(8, 24)(torch.randn(2, 6, 8))  # (B, L, 3 heads of 8), a view of nn.Linear's (B·L, 24)
    fact = regrouped(proj.view(2, 3, 6, 8), -2)
    assert fact is not None and fact["held"][:2] == _reference(2, 6, 3, 8) and fact["tokens"] == 6
    assert regrouped(proj.view(2, 6, 3, 8).transpose(1, 2), -2) is None  # (the transpose: whole tokens)
    assert regrouped(proj.view(2, 3, 6, 8).transpose(-2, -1), -1) == fact  # (kᵀ: its positions last)
    assert regrouped(proj.view(2, 6 * 3, 8), -2) is None  # (each token cut in three positions: 18 are no sample's 6)
    features = torch.nn.Linear(4, 5 * 8)(torch.randn(2, 4)).view(2, 5, 8)  # a tabular model's per-feature tokens
    assert regrouped(features, -2) is None


def _fold_reference(batch: int, tokens: int, heads: int, dim: int) -> list[tuple[int, int]]:
    """(token, first feature) of positions 0 and 1 of plane 0 of `x.view(B·H, -1, D)` of a (B, L, H·D) tensor, read
    off torch's view of one whose values are their own (token, feature)."""
    width = heads * dim
    x = torch.arange(batch * tokens * width).view(batch, tokens, width)
    viewed = x.view(batch * heads, -1, dim)
    return [(int(viewed[0, i, 0]) // width, int(viewed[0, i, 0]) % width) for i in range(2)]


def test_fuxictr_autoint_heads_folded_by_view_is_found(tmp_path):
    # reczoo/FuxiCTR#30 (abd5182): AutoInt's MultiHeadAttention split heads by query.view(batch_size * num_heads, -1,
    # attention_dim) of the (32, 8 fields, 2 heads of 16) projection; torch.bmm, nn.Softmax(dim=2): each (sample, head)
    # plane holds 4 of the 8 fields cut into head slices
    found = check_bug(tmp_path, "fuxictr_autoint_heads_split_by_view_mixes_fields", "positions-regrouped")
    assert _held(found[0]["message"]) == _fold_reference(32, 8, 2, 16)
    assert "4 of the 8 tokens" in found[0]["message"] and "(8, 32) projection" in found[0]["message"]


def test_a_text_encoder_folding_heads_by_view_before_sdpa_is_found(tmp_path):
    # written otherwise: a fused qkv Linear over right-padded ids, each part viewed (B·H, -1, D), 3-D SDPA with the key
    # padding repeated per head, sizes in a config dict
    found = check_bug(tmp_path, "text_encoder_fold_heads_view_sdpa_padding", "positions-regrouped", folder=REGROUPED)
    assert _held(found[0]["message"]) == _fold_reference(3, 9, 4, 6)


def test_folds_that_step_whole_tokens_are_quiet_and_the_folded_view_is_not():
    proj = torch.nn.Linear(8, 24)(torch.randn(2, 6, 8))  # (B, L, 3 heads of 8)
    fact = regrouped(proj.view(2 * 3, -1, 8), -2)
    assert fact is not None and fact["held"][:2] == _fold_reference(2, 6, 3, 8) and fact["tokens"] == 6
    assert regrouped(proj.view(2, 6, 3, 8).transpose(1, 2).reshape(6, 6, 8), -2) is None  # (the fix: a copy)
    assert regrouped(proj.transpose(0, 1).reshape(6, 2 * 3, 8).transpose(0, 1), -2) is None  # (MHA's (L, B·H, D))
    assert regrouped(proj.view(2 * 2, 3, 24), -2) is None  # (chunks of whole tokens: a local attention's blocks)
    assert regrouped(proj.view(2, 6, 3, 8).view(2 * 6, 3, 8), -2) is None  # (each token's heads as positions: no fold)


def test_tgm_tgat_heads_split_by_a_copying_reshape_is_found(tmp_path):
    # tgm-team/tgm#168 (a706f75d): TemporalAttention's K.reshape(B, n_heads, -1, head_dim) of K = Z[:, :, :out_dim], a
    # (16, 10 neighbours, 4 heads of 16) slice of the fused KV projection: the reshape copies (no strides to read), the
    # einsum "bhld,bhnd->bhln" multiplies it; each head's plane holds 2.5 of the 10 neighbours cut into head slices
    found = check_bug(tmp_path, "tgm_tgat_temporal_attention_head_split_mixes_neighbors_and_padding",
                      "positions-regrouped")
    assert _held(found[0]["message"]) == _reference(16, 10, 4, 16)
    assert "a reshape (a copy) of a (10, 64) projection" in found[0]["message"]


def test_a_set_transformer_reshaping_chunked_keys_heads_first_before_sdpa_is_found(tmp_path):
    # written otherwise: a PMA block's fused key-value Linear chunked in two, each half .reshape(B, H, N, D) (a copy),
    # SDPA with right-padded point sets' key mask, sizes in a dataclass
    found = check_bug(tmp_path, "set_transformer_kv_chunk_reshape_heads_first_sdpa", "positions-regrouped",
                      folder=REGROUPED)
    assert _held(found[0]["message"]) == _reference(4, 12, 3, 16)
    assert "keys are a reshape (a copy)" in found[0]["message"]


def test_copying_reshapes_are_read_only_where_heads_come_before_positions():
    from maskcli.trace.regrouped import _split, einsum_axes

    kv = torch.nn.Linear(8, 48)(torch.randn(2, 6, 8))  # (B, L, 2 · 3 heads of 8), requiring grad
    key = kv[..., :24]  # (a strided half: any reshape of it to heads copies)
    fact = regrouped(key.reshape(2, 3, 6, 8), -2)
    assert fact is not None and fact["held"][:2] == _reference(2, 6, 3, 8) and fact["copied"]
    assert regrouped(key.reshape(2, 3, 6, 8).transpose(-2, -1), -1) == fact  # (kᵀ of the copy)
    assert regrouped(key.reshape(2, 6, 3, 8).transpose(1, 2), -2) is None  # (the fix)
    assert regrouped(key.reshape(2, 3, 6, 8).transpose(-2, -1), -2) is None  # (its features, not its positions)
    assert _split((2, 6, 36), (2, 6, 6, 6)) is None  # (H = L: no telling heads from positions)
    assert _split((2, 6, 24), (2, 6, 3, 8)) is None and _split((2, 6, 24), (2, 3, 6, 8))["step"] == 8
    with torch.no_grad():
        assert regrouped(key.reshape(2, 6, 3, 8).transpose(1, 2), -2) is None
    assert einsum_axes("bhld,bhnd->bhln") == (-2, -2) and einsum_axes("bhqd,bhdk->bhqk") == (-2, -1)
    assert einsum_axes("bqhd,bkhd->bhqk") is None  # (positions not among the last two axes: not read here)
def _laid_reference(batch: int, tokens: int, heads: int, dim: int, offset: int = 0, width: int | None = None) -> tuple:
    """The first (head-axis index, query, key) of the kernel's (B, L, H, H) scores at which a query and a different key
    are slices of one token, by a double loop over `x.view(B, L, H, D)` of a (B, L, width) tensor (its part from
    `offset`) whose values are their own (token, feature), handed on as (B, H, L, D) is read; and (token, first feature)
    of positions 0 and 1."""
    width = width or heads * dim
    x = torch.arange(batch * tokens * width).view(batch, tokens, width)[..., offset:offset + heads * dim]
    laid = x.reshape(batch, tokens, heads, dim) if x.is_contiguous() else x.unflatten(-1, (heads, dim))
    token = lambda a, p: int(laid[0, a, p, 0]) // width  # noqa: E731 - the token kernel position p of plane a holds
    cell = first((tokens, heads, heads), lambda a, q, k: q != k and token(a, q) == token(a, k))
    return cell, [(token(0, p), int(laid[0, 0, p, 0]) % width) for p in range(2)]


def test_stylish_tts_conformer_handing_sdpa_b_n_h_d_is_found(tmp_path):
    # Stylish-TTS/stylish-tts b97a5b6 "Make SDPA working with mask": the conformer Attention rearranged q/k/v to
    # "b n h d" before F.scaled_dot_product_attention, which reads "b h n d": each of the 40 mel frames attends over
    # its own 8 heads (dim_head 16, k and v chunked from one to_kv Linear 256 wide)
    found = check_bug(tmp_path, "stylish_tts_ringformer_conformer_sdpa_attends_across_heads", "heads-as-positions")
    cell, held = _laid_reference(2, 40, 8, 16, width=256)
    assert cell == (0, 0, 1)  # (frame 0's query at position 0 and key at position 1: two heads of frame 0)
    assert _held(found[0]["message"]) == held
    assert "the module states 8 heads" in found[0]["message"] and "not over the 40 tokens" in found[0]["message"]


def test_a_music_decoder_missing_its_transpose_before_a_handwritten_softmax_is_found(tmp_path):
    # written otherwise: a decoder-only model, config dataclass, q/k/v .view(B, T, n_head, head_dim) with no transpose,
    # q @ kᵀ, a causal triangle built from the scores' last axis (4 x 4: over heads), torch.softmax
    found = check_bug(tmp_path, "music_decoder_softmax_heads_as_positions", "heads-as-positions", folder=REGROUPED)
    cell, held = _laid_reference(3, 11, 4, 8)
    assert cell == (0, 0, 1)
    assert _held(found[0]["message"]) == held and "not over the 11 tokens" in found[0]["message"]


def test_bands_handed_to_sdpa_on_purpose_are_quiet(tmp_path):
    # a frame's sub-band tokens laid (B, T, bands, D) for SDPA on purpose: its module states no head count, or one that
    # is not its band count; the enclosing block's 6 heads (as many as bands) are not the band module's
    status, found, report = traced(tmp_path, "subband_frame_attention_sdpa_quiet", False, REGROUPED)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report


def test_a_layout_that_lays_heads_as_positions_is_read_off_its_strides():
    proj = torch.nn.Linear(8, 24)(torch.randn(2, 6, 8))  # (B, L, 3 heads of 8)
    fact = swapped(proj.view(2, 6, 3, 8), -2)
    assert fact is not None and (fact["tokens"], fact["heads"], fact["step"]) == (6, 3, 8)
    assert fact["held"][:2] == _laid_reference(2, 6, 3, 8)[1]
    assert swapped(proj.view(2, 6, 3, 8).transpose(1, 2), -2) is None  # (the fix: positions step whole tokens)
    assert swapped(proj.view(2, 6, 3, 8).transpose(-2, -1), -1) == fact  # (kᵀ: its positions last)
    assert swapped(proj.view(2, 3, 6, 8), -2) is None  # (Informer's view: positions-regrouped's)
    assert swapped(proj.view(2, 6, 3, 8).contiguous().clone(), -2) is None  # (a copy: its strides say nothing)
