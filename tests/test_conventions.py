"""The five conventions, for numpy arrays and torch tensors, against what PyTorch's APIs take."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from maskcli.conventions import DTYPES, FLOAT_MIN, bytes_per_cell, cell_texts, describe, rounded, to_convention
from maskcli.mask import build

keep_arrays = st.integers(1, 6).flatmap(
    lambda n: st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=1, max_size=6)
).map(lambda rows: np.array(rows, dtype=bool))


@settings(max_examples=50, deadline=None)
@given(keep=keep_arrays, dtype=st.sampled_from(DTYPES), as_torch=st.booleans())
def test_every_convention(keep, dtype, as_torch):
    given_keep = torch.from_numpy(keep) if as_torch else keep
    cells = [(i, j) for i in range(keep.shape[0]) for j in range(keep.shape[1])]
    visible = {cell for cell in cells if keep[cell]}

    same = to_convention(given_keep, "keep")
    assert same.dtype in (torch.bool, np.bool_) and (same == given_keep).all()
    same[...] = ~same  # a copy: changing it leaves the mask alone
    assert not (same == given_keep).all()

    block = to_convention(given_keep, "block")
    assert all(bool(block[cell]) == (cell not in visible) for cell in cells)
    integer = to_convention(given_keep, "int")
    assert all(int(integer[cell]) == (1 if cell in visible else 0) for cell in cells)
    additive = to_convention(given_keep, "additive", dtype)
    assert all(float(additive[cell]) == (0.0 if cell in visible else -math.inf) for cell in cells)
    lowest = to_convention(given_keep, "min", dtype)
    assert all(float(lowest[cell]) == (0.0 if cell in visible else FLOAT_MIN[dtype]) for cell in cells)
    for convention in ("keep", "block", "int", "additive", "min"):
        out = to_convention(given_keep, convention, dtype)
        size = out.element_size() if isinstance(out, torch.Tensor) else out.itemsize
        assert size == bytes_per_cell(convention, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_min_fill_is_the_lowest_finite_value_of_the_dtype(dtype):
    assert FLOAT_MIN[dtype] == torch.finfo(getattr(torch, dtype)).min
    masked = to_convention(torch.tensor([[True, False]]), "min", dtype)
    assert masked.dtype == getattr(torch, dtype) and masked[0, 1].item() == torch.finfo(masked.dtype).min


def test_cell_texts_and_descriptions():
    assert cell_texts("block") == ("0", "1") and describe("block") == "block (bool, 1 = True = masked, 0 = may attend)"
    assert cell_texts("min", "float16") == ("0", "-65504")
    assert describe("keep") == "keep (bool, 1 = True = may attend, 0 = masked)"
    assert describe("additive", "bfloat16") == "additive bfloat16 (0 = may attend, -inf = masked)"


def test_unknown_convention_is_refused():
    with pytest.raises(ValueError, match="sideways"):
        to_convention(np.ones((2, 2), dtype=bool), "sideways")


@pytest.mark.parametrize("given_keep", [torch.tensor([1, 0]), np.array([1.5, 0.0]), torch.tensor([0.0, -1e9]), None, [True, False]])
def test_a_keep_mask_that_is_not_bool_is_refused(given_keep):
    """An int keep mask's ~ is a bitwise not (block gave -2, -1 for 1, 0) and a float's truth is any nonzero (an
    additive -1e9 read as kept): the notebook API refuses them, and what is no array, with a TypeError saying what
    it takes, not an AttributeError from inside."""
    for convention in ("keep", "block", "int", "additive", "min"):
        with pytest.raises(TypeError, match="to_convention takes a bool keep mask"):
            to_convention(given_keep, convention)


def test_conventions_mean_the_same_to_pytorch_attention():
    """keep, additive and min in SDPA, and block in nn.MultiheadAttention, all give the same output."""
    torch.manual_seed(0)
    keep = build("window(3)", length=6, lengths="6,4").materialize().contiguous()  # every row sees a key
    q, k, v = (torch.randn(2, 1, 6, 4) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    want = sdpa(q, k, v, attn_mask=keep)
    by_hand = torch.softmax(((q @ k.transpose(-1, -2)) / 2.0).masked_fill(~keep, float("-inf")), dim=-1) @ v
    torch.testing.assert_close(want, by_hand)
    torch.testing.assert_close(sdpa(q, k, v, attn_mask=to_convention(keep, "additive")), want)
    torch.testing.assert_close(sdpa(q, k, v, attn_mask=to_convention(keep, "min")), want)
    mha = torch.nn.MultiheadAttention(4, 1, batch_first=True, bias=False)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([torch.eye(4)] * 3))
        mha.out_proj.weight.copy_(torch.eye(4))
    out, _ = mha(q[:, 0], k[:, 0], v[:, 0], attn_mask=to_convention(keep, "block")[:, 0], need_weights=False)
    torch.testing.assert_close(out, want[:, 0])


@settings(max_examples=300, deadline=None)
@given(value=st.one_of(
    st.floats(-3.5e38, -3.3e38), st.floats(-66000.0, -65000.0), st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([-65504.0, -65519.99, -65520.0, FLOAT_MIN["bfloat16"], FLOAT_MIN["float32"], -1e9, -1e4]),
))
def test_rounded_casts_as_torch_does(value):
    for dtype in ("float16", "bfloat16", "float32"):
        expected = torch.tensor(value, dtype=torch.float64).to(getattr(torch, dtype)).item()
        assert rounded(value, dtype) == expected, (value, dtype)


def test_float_minimums_are_torchs():
    for dtype in DTYPES:
        assert FLOAT_MIN[dtype] == torch.finfo(getattr(torch, dtype)).min
