"""--like pipelines against the libraries themselves: each reproduces its reference cell for cell on this machine."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from maskcli.attention.stages import attend


def inputs(batch=2, heads=3, q_len=5, k_len=7, dim=4, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, generator=generator).to(dtype)
    k = torch.randn(batch, heads, k_len, dim, generator=generator).to(dtype)
    v = torch.randn(batch, heads, k_len, dim, generator=generator).to(dtype)
    keep = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)[None, None].repeat(batch, 1, 1, 1)
    keep[-1, :, 1] = False  # a query of the last batch row sees no key
    keep[-1, :, :, 0] = False  # and key 0 is padding there
    return q, k, v, keep


def test_tutorial_is_masked_fill_then_softmax_of_the_divided_scores():
    q, k, v, keep = inputs()
    stages = attend(q, k, v, keep, like="tutorial")
    # the classic tutorial, written out: mask == 0 -> -inf, then softmax(masked / sqrt(d_k))
    scores = q @ k.transpose(-2, -1)
    masked = scores.masked_fill(keep == 0, -torch.inf)
    weights = torch.softmax(masked / k.shape[-1] ** 0.5, dim=-1)
    assert torch.equal(stages.weights.nan_to_num(7.0), weights.nan_to_num(7.0))
    assert torch.isnan(stages.weights[1, :, 1]).all()  # the row that sees no key is NaN
    assert torch.equal(stages.output.nan_to_num(7.0), (weights @ v).nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_sdpa_is_the_math_backend(dtype):
    q, k, v, keep = inputs(dtype=dtype)
    stages = attend(q, k, v, keep, like="sdpa")
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert torch.equal(stages.output, expected)
    assert (stages.weights[1, :, 1] == 0).all() and (stages.output[1, :, 1] == 0).all()  # _safe_softmax: zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_hf_eager_is_eager_attention_forward(dtype):
    q, k, v, keep = inputs(dtype=dtype)  # query 1 of the last batch row sees no key
    stages = attend(q, k, v, keep, like="hf-eager")

    # Hugging Face's eager_mask (masking_utils) and eager_attention_forward, as its models write them
    scaling = q.shape[-1] ** -0.5
    attention_mask = torch.where(keep, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)
    attn_weights = torch.matmul(q, k.transpose(2, 3)) * scaling
    attn_weights = attn_weights + attention_mask
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    attn_output = torch.matmul(attn_weights, v)

    assert torch.equal(stages.masked, torch.matmul(q, k.transpose(2, 3)) * scaling + attention_mask)
    assert torch.equal(stages.weights.nan_to_num(7.0), attn_weights.nan_to_num(7.0))
    assert torch.equal(stages.output.nan_to_num(7.0), attn_output.nan_to_num(7.0))
    row = stages.weights[1, 0, 1].float()
    if dtype == torch.float64:  # finfo(float64).min is -inf in float32: the row has no finite score
        assert torch.isnan(row).all() and torch.isnan(stages.output[1, :, 1]).all()
        assert not torch.isnan(stages.weights[0]).any()
    else:
        assert torch.allclose(row, torch.full_like(row, 1 / keep.shape[-1]), atol=1e-2)  # uniform where no key is seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_hf_eager_is_the_installed_transformers(dtype):
    """Where transformers is installed (it is not a dependency): its own eager_mask and eager_attention_forward."""
    mu = pytest.importorskip("transformers.masking_utils")
    eager_attention_forward = pytest.importorskip("transformers.models.llama.modeling_llama").eager_attention_forward
    q, k, v, keep = inputs(dtype=dtype, q_len=5, k_len=5)
    keep = keep & torch.ones(5, 5, dtype=torch.bool).tril()
    mask = mu.eager_mask(batch_size=2, q_length=5, kv_length=5, mask_function=lambda b, h, i, j: keep[b, 0, i, j], dtype=dtype)
    module = torch.nn.Module().eval()
    module.num_key_value_groups = 1
    output, weights = eager_attention_forward(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)
    stages = attend(q, k, v, keep, like="hf-eager")
    assert torch.equal(stages.weights.nan_to_num(7.0), weights.nan_to_num(7.0))
    assert torch.equal(stages.output.transpose(1, 2).nan_to_num(7.0), output.nan_to_num(7.0))
    assert bool(torch.isnan(weights[1, :, 1]).all()) == (dtype == torch.float64)


def mha_with_identity_projections(embed: int, heads: int) -> torch.nn.MultiheadAttention:
    mha = torch.nn.MultiheadAttention(embed, heads, bias=False, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.eye(embed).repeat(3, 1))
        mha.out_proj.weight.copy_(torch.eye(embed))
    return mha.eval()


def as_mha(t: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> (B, L, H*D), the embedding nn.MultiheadAttention splits into heads."""
    batch, heads, length, dim = t.shape
    return t.transpose(1, 2).reshape(batch, length, heads * dim)


def test_mha_weights_are_need_weights_true():
    q, k, v, keep = inputs(batch=1)
    batch, heads, q_len, dim = q.shape
    stages = attend(q, k, v, keep, like="mha-weights")
    mha = mha_with_identity_projections(heads * dim, heads)
    block = ~keep.expand(batch, heads, q_len, k.shape[2]).reshape(batch * heads, q_len, -1)  # MHA reads True as masked
    with torch.no_grad():
        out, weights = mha(as_mha(q), as_mha(k), as_mha(v), attn_mask=block, need_weights=True, average_attn_weights=False)
    assert torch.equal(stages.weights.nan_to_num(7.0), weights.nan_to_num(7.0))  # NaN on the row that sees no key
    assert torch.allclose(as_mha(stages.output), out, atol=1e-6, equal_nan=True)


def test_mha_is_need_weights_false():
    q, k, v, keep = inputs(batch=1)
    keep[-1, :, 1] = True  # MHA's fast paths differ on rows that see no key; compare the rows that see some
    batch, heads, q_len, dim = q.shape
    stages = attend(q, k, v, keep, like="mha")
    mha = mha_with_identity_projections(heads * dim, heads)
    block = ~keep.expand(batch, heads, q_len, k.shape[2]).reshape(batch * heads, q_len, -1)
    with torch.no_grad():
        out, weights = mha(as_mha(q), as_mha(k), as_mha(v), attn_mask=block, need_weights=False)
    assert weights is None
    assert torch.allclose(as_mha(stages.output), out, atol=1e-6)


def test_dropout_is_nn_dropout_after_manual_seed():
    q, k, v, keep = inputs()
    plain = attend(q, k, v, keep, like="tutorial")
    dropped = attend(q, k, v, keep, like="tutorial", dropout=0.5, seed=123)
    torch.manual_seed(123)
    expected = torch.nn.Dropout(0.5)(plain.weights)
    assert torch.equal(dropped.weights.nan_to_num(7.0), expected.nan_to_num(7.0))


def test_fill_without_like_keeps_its_meaning():
    q, k, v, keep = inputs()
    stages = attend(q, k, v, keep, fill="min")
    scaled = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(q.shape[-1]))
    assert torch.equal(stages.weights, torch.softmax(scaled.masked_fill(~keep, torch.finfo(torch.float32).min), dim=-1))
    assert stages.unmasked is None and attend(q, k, v, keep, unmasked=True).unmasked is not None
