"""maskcli.attention.attend against independent references (its findings: test_checks_stages.py).

References: F.scaled_dot_product_attention on the math backend, a softmax written out here,
nn.MultiheadAttention with the same projection weights (the classic notebook comparison),
and literal numbers.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from maskcli.attention.stages import attend, fill_value
from flags import from_flags

# One example of every kind (and a kind combined with key padding).
EVERY_KIND = {
    "causal": ("causal", dict(length=7)),
    "tril": ("tril", dict(length=6, diagonal=-1)),
    "tril-keep-d1": ("tril", dict(length=5, diagonal=1)),
    "triu": ("triu", dict(length=6)),
    "triu-d2": ("triu", dict(length=6, diagonal=2)),
    "padding": ("padding", dict(lengths="6,3,1")),
    "prefill": ("prefill", dict(offset=4, length=3)),
    "decode": ("prefill", dict(offset=6, length=1)),
    "chunk": ("chunk", dict(chunks="0,0,1,1,1,2")),
    "window": ("window", dict(length=8, window=3)),
    "prefix": ("prefix", dict(length=7, prefix=3)),
    "document": ("document", dict(chunks="0,0,0,1,1,2,2")),
    "causal+lengths": ("causal", dict(length=6, lengths="6,4")),
    "window+lengths": ("window", dict(length=6, window=2, lengths="5,6")),
}


def qkv_for(spec, *, heads=2, dim=8, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    lead = (spec.batch, heads)
    q = torch.randn(*lead, spec.frame.q_len, dim, generator=generator, dtype=torch.float64).to(dtype)
    k = torch.randn(*lead, spec.frame.k_len, dim, generator=generator, dtype=torch.float64).to(dtype)
    v = torch.randn(*lead, spec.frame.k_len, dim, generator=generator, dtype=torch.float64).to(dtype)
    return q, k, v


def sdpa_math(q, k, v, keep, scale=None):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)


def reference_weights(q, k, keep, scale):
    """softmax(q kᵀ · scale, masked_fill -inf), in float64, written out with einsum."""
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)


def seen_rows(keep, shape):
    """Bool (B, H, Lq): query rows that see at least one key."""
    return keep.expand(shape).any(dim=-1)


@pytest.mark.parametrize("name", list(EVERY_KIND))
def test_every_kind_matches_sdpa_math_and_a_written_out_softmax(name):
    kind, options = EVERY_KIND[name]
    spec = from_flags(kind, heads=2, **options)
    keep = spec.materialize()
    q, k, v = qkv_for(spec, seed=len(name))
    stages = attend(q, k, v, keep)
    shape = (spec.batch, 2, spec.frame.q_len, spec.frame.k_len)
    assert stages.scores.shape == stages.weights.shape == shape
    assert stages.output.shape == (spec.batch, 2, spec.frame.q_len, 8)
    assert stages.scale == pytest.approx(1 / math.sqrt(8))

    rows = seen_rows(keep, shape)
    assert rows.any()
    expected = sdpa_math(q, k, v, keep)
    assert (stages.output - expected)[rows].abs().max().item() <= 1e-6

    weights = reference_weights(q, k, keep, 1 / math.sqrt(8))
    assert (stages.weights.double() - weights)[rows].abs().max().item() <= 1e-6
    # masked cells have weight exactly zero; the stages before the mask are the plain products
    full_keep = keep.expand(shape)
    hidden = ~full_keep & rows[..., None]  # masked cells of rows that see a key
    assert bool((stages.weights[hidden] == 0).all())
    assert bool(torch.isnan(stages.weights[~rows]).all())  # tril with diagonal -1: row 0 sees nothing
    assert torch.allclose(stages.scores.double(), torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()), atol=1e-5)
    assert torch.allclose(stages.scaled, stages.scores / math.sqrt(8), atol=1e-6)
    assert bool(torch.isneginf(stages.masked[~full_keep]).all())
    assert torch.equal(stages.masked[full_keep], stages.scaled[full_keep])
    assert torch.equal(stages.keep, full_keep)
    # the output is weights @ v, row by row
    assert torch.allclose(stages.output[rows], (weights @ v.double()).float()[rows], atol=1e-6)


def test_every_kind_has_a_row_a_query_can_see_and_sums_to_one():
    for kind, options in EVERY_KIND.values():
        spec = from_flags(kind, **options)
        keep = spec.materialize()
        stages = attend(*qkv_for(spec, heads=1), keep)
        sums = stages.weights.sum(-1)
        rows = seen_rows(keep, sums.shape + (spec.frame.k_len,))
        assert torch.allclose(sums[rows], torch.ones_like(sums[rows]), atol=1e-6), kind


@st.composite
def mask_specs(draw):
    kind = draw(st.sampled_from(["causal", "tril", "triu", "padding", "prefill", "chunk", "window", "prefix", "document"]))
    length = draw(st.integers(1, 9))
    options: dict = {}
    if kind in ("chunk", "document"):
        labels = sorted(draw(st.lists(st.integers(0, 3), min_size=1, max_size=9)))
        options["chunks"] = ",".join(map(str, labels))
    elif kind == "prefill":
        options.update(length=length, offset=draw(st.integers(0, 6)))
    else:
        options["length"] = length
    if kind in ("tril", "triu"):
        options["diagonal"] = draw(st.integers(-3, 3))
        options["means"] = draw(st.sampled_from(["keep", "block"]))
    if kind == "window":
        options["window"] = draw(st.integers(1, 10))
    if kind == "prefix":
        options["prefix"] = draw(st.integers(1, length))
    if kind == "padding" or draw(st.booleans()):
        k_len = len(options["chunks"].split(",")) if "chunks" in options else length + options.get("offset", 0)
        lengths = draw(st.lists(st.integers(0, k_len), min_size=1, max_size=3))
        options["lengths"] = ",".join(map(str, lengths))
    return kind, options


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=mask_specs(), heads=st.integers(1, 3), dim=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_random_masks_and_sizes_match_sdpa_math(case, heads, dim, seed):
    kind, options = case
    spec = from_flags(kind, heads=heads, **options)
    keep = spec.materialize()
    q, k, v = qkv_for(spec, heads=heads, dim=dim, seed=seed)
    stages = attend(q, k, v, keep)
    shape = (spec.batch, heads, spec.frame.q_len, spec.frame.k_len)
    rows = seen_rows(keep, shape)
    if rows.any():
        assert (stages.output - sdpa_math(q, k, v, keep))[rows].abs().max().item() <= 1e-6
        weights = reference_weights(q, k, keep, 1 / math.sqrt(dim))
        assert (stages.weights.double() - weights)[rows].abs().max().item() <= 1e-6
    # a row that sees no key is NaN under -inf, whatever SDPA does with it
    assert bool(torch.isnan(stages.weights[~rows]).all())


@settings(max_examples=25, deadline=None)
@given(scale=st.floats(0.01, 3.0), length=st.integers(1, 8), offset=st.integers(0, 5))
def test_scale_override_matches_sdpa_scale(scale, length, offset):
    spec = from_flags("prefill", offset=offset, length=length)
    keep = spec.materialize()
    q, k, v = qkv_for(spec, dim=5, seed=length + 10 * offset)
    stages = attend(q, k, v, keep, scale=scale)
    assert stages.scale == scale
    assert torch.allclose(stages.scaled, stages.scores * scale)
    # a large scale makes large logits, where float32 rounding alone (SDPA scales q and k by sqrt(scale)
    # each) tells the two apart: compare both with float64, and each other within what rounding allows
    exact = sdpa_math(q.double(), k.double(), v.double(), keep, scale=scale)
    ours, theirs = (stages.output - exact).abs().max().item(), (sdpa_math(q, k, v, keep, scale=scale) - exact).abs().max().item()
    rounding = torch.finfo(torch.float32).eps * stages.scaled.abs().max().item() * v.abs().max().item()
    assert ours <= max(1e-6, 2 * theirs, rounding), (ours, theirs, rounding)
    if scale <= 1 / math.sqrt(5):
        assert (stages.output - sdpa_math(q, k, v, keep, scale=scale)).abs().max().item() <= 1e-6


def test_float64_computes_in_float64_and_matches_to_float64_precision():
    spec = from_flags("window", length=6, window=2)
    keep = spec.materialize()
    q, k, v = qkv_for(spec, dtype=torch.float64)
    stages = attend(q, k, v, keep)
    for name in ("scores", "scaled", "masked", "weights", "output"):
        assert stages.stage(name).dtype == torch.float64, name
    assert (stages.output - sdpa_math(q, k, v, keep)).abs().max().item() <= 1e-12
    assert (stages.weights - reference_weights(q, k, keep, 1 / math.sqrt(8))).abs().max().item() <= 1e-12


def test_a_single_query_over_two_keys_by_hand():
    # scores 0·0+1·1 = 1 and 2·0+0·1 = 0, scale 1: weights softmax([1, 0]) = (e/(e+1), 1/(e+1))
    q = torch.tensor([[[[0.0, 1.0]]]])
    k = torch.tensor([[[[0.0, 1.0], [2.0, 0.0]]]])
    v = torch.tensor([[[[10.0, 0.0], [0.0, 10.0]]]])
    stages = attend(q, k, v, torch.ones(1, 1, 1, 2, dtype=torch.bool), scale=1.0)
    e = math.e
    assert stages.scores.flatten().tolist() == [1.0, 0.0]
    assert stages.weights.flatten().tolist() == pytest.approx([e / (e + 1), 1 / (e + 1)], abs=1e-7)
    assert stages.output.flatten().tolist() == pytest.approx([10 * e / (e + 1), 10 / (e + 1)], abs=1e-6)
    hidden = attend(q, k, v, torch.tensor([[[[False, True]]]]), scale=1.0)
    assert hidden.weights.flatten().tolist() == [0.0, 1.0]
    assert hidden.output.flatten().tolist() == [0.0, 10.0]


# --- nn.MultiheadAttention: the classic notebook comparison ---------------------------------


def mha_with(w_q, w_k, w_v, heads):
    """nn.MultiheadAttention whose in-projection is three given Linear weights and whose out-projection is identity."""
    embed = w_q.shape[0]
    mha = torch.nn.MultiheadAttention(embed, heads, bias=False, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([w_q, w_k, w_v]))
        mha.out_proj.weight.copy_(torch.eye(embed))
        if mha.out_proj.bias is not None:
            mha.out_proj.bias.zero_()
    return mha


def projected(x, layer, heads):
    batch, length, embed = x.shape
    return layer(x).view(batch, length, heads, embed // heads).transpose(1, 2)


@pytest.mark.parametrize("how", ["key_padding_mask", "attn_mask 2-D + key_padding_mask", "attn_mask 3-D"])
@pytest.mark.parametrize("kind, options", [("padding", dict(lengths="5,3,1")), ("causal", dict(length=5, lengths="5,2,4"))])
def test_matches_multihead_attention_with_identical_projections(how, kind, options):
    heads, embed = 2, 6
    spec = from_flags(kind, heads=heads, **options)
    keep = spec.materialize().expand(spec.batch, heads, spec.frame.q_len, spec.frame.k_len)
    torch.manual_seed(123)
    x = torch.randn(spec.batch, spec.frame.k_len, embed)
    linears = [torch.nn.Linear(embed, embed, bias=False) for _ in range(3)]
    mha = mha_with(*(layer.weight.detach() for layer in linears), heads)

    lengths = [int(n) for n in options["lengths"].split(",")]
    key_padding = torch.tensor([[j >= n for j in range(spec.frame.k_len)] for n in lengths])  # True = pad
    causal_block = torch.triu(torch.ones(spec.frame.q_len, spec.frame.k_len, dtype=torch.bool), 1) if kind == "causal" else None
    if how == "key_padding_mask":
        mask_args = dict(attn_mask=causal_block, key_padding_mask=key_padding)
    elif how.startswith("attn_mask 2-D"):
        if causal_block is None:
            causal_block = torch.zeros(spec.frame.q_len, spec.frame.k_len, dtype=torch.bool)
        mask_args = dict(attn_mask=causal_block, key_padding_mask=key_padding)
    else:  # the whole mask in block convention, one (L, S) per batch row and head, batch-major
        mask_args = dict(attn_mask=(~keep).reshape(spec.batch * heads, spec.frame.q_len, spec.frame.k_len))

    with torch.no_grad():
        out, weights = mha(x, x, x, need_weights=True, average_attn_weights=False, **mask_args)
        q, k, v = (projected(x, layer, heads) for layer in linears)
    stages = attend(q, k, v, keep)
    assert weights.shape == (spec.batch, heads, spec.frame.q_len, spec.frame.k_len)
    assert (stages.weights - weights).abs().max().item() <= 1e-6
    merged = stages.output.transpose(1, 2).reshape(spec.batch, spec.frame.q_len, embed)
    assert (merged - out).abs().max().item() <= 1e-6
    # and both agree with the mask: masked keys get no weight
    assert bool((weights[~keep] == 0).all())


# --- fills ----------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(case=mask_specs(), seed=st.integers(0, 1000))
def test_multiply_equals_minus_inf_on_rows_that_see_a_key(case, seed):
    kind, options = case
    spec = from_flags(kind, heads=2, **options)
    keep = spec.materialize()
    q, k, v = qkv_for(spec, seed=seed)
    by_inf = attend(q, k, v, keep, fill="-inf")
    by_multiply = attend(q, k, v, keep, fill="multiply")
    rows = seen_rows(keep, by_inf.weights.shape)
    assert (by_inf.weights - by_multiply.weights)[rows].abs().max().item() <= 1e-6 if rows.any() else True
    assert (by_inf.output - by_multiply.output)[rows].abs().max().item() <= 1e-6 if rows.any() else True
    # multiply softmaxes before masking: its "masked" stage is the scaled scores untouched
    assert torch.equal(by_multiply.masked, by_multiply.scaled)
    assert bool(torch.isnan(by_multiply.weights[~rows]).all())


def test_fully_masked_rows_per_fill_in_float32():
    spec = from_flags("causal", length=4, lengths="4,0", heads=2)
    keep = spec.materialize()
    q, k, v = qkv_for(spec)
    by_inf = attend(q, k, v, keep, fill="-inf")
    assert bool(torch.isnan(by_inf.weights[1]).all()) and bool(torch.isnan(by_inf.output[1]).all())
    assert not torch.isnan(by_inf.weights[0]).any()
    for fill in ("min", "-1e9"):
        stages = attend(q, k, v, keep, fill=fill)
        assert stages.weights.dtype == torch.float32
        assert torch.equal(stages.weights[1], torch.full((2, 4, 4), 0.25)), fill  # uniform 1/Lk
        # uniform weights: the output is the mean of V over every (masked) key
        assert torch.allclose(stages.output[1], v[1].mean(dim=-2, keepdim=True).expand(2, 4, 8), atol=1e-6)
        assert torch.allclose(stages.weights[0], by_inf.weights[0], atol=1e-6), fill
    assert attend(q, k, v, keep, fill="min").masked[1].unique().tolist() == [torch.finfo(torch.float32).min]
    assert attend(q, k, v, keep, fill="-1e9").masked[1].unique().tolist() == [-1e9]


def test_fill_values_as_each_dtype_stores_them():
    assert fill_value("-inf", torch.float32) == float("-inf")
    assert fill_value("min", torch.float16) == -65504.0
    assert fill_value("min", torch.float32) == torch.finfo(torch.float32).min
    assert fill_value("-1e9", torch.float32) == -1e9
    assert fill_value("-1e9", torch.float16) == float("-inf")  # overflows: float16 stops at -65504
    assert fill_value("-1e9", torch.bfloat16) == pytest.approx(-1e9, rel=1e-2)
    assert fill_value("-1e9", torch.float64) == -1e9
    with pytest.raises(ValueError):
        fill_value("multiply", torch.float32)
    with pytest.raises(ValueError):
        attend(*qkv_for(from_flags("causal", length=2)), torch.ones(2, 2, dtype=torch.bool), fill="zero")


def test_dropout_is_seeded_and_scales_the_kept_weights():
    spec = from_flags("causal", length=8)
    keep = spec.materialize()
    q, k, v = qkv_for(spec, heads=1)
    plain = attend(q, k, v, keep)
    first = attend(q, k, v, keep, dropout=0.25, seed=5)
    again = attend(q, k, v, keep, dropout=0.25, seed=5)
    other = attend(q, k, v, keep, dropout=0.25, seed=6)
    assert torch.equal(first.weights, again.weights)
    assert not torch.equal(first.weights, other.weights)
    dropped = first.weights == 0
    assert torch.allclose(first.weights[~dropped], plain.weights[~dropped] / 0.75)
    assert bool(dropped[keep.expand(dropped.shape)].any())  # something visible was dropped
    assert torch.allclose(first.output, first.weights @ v, atol=1e-6)
