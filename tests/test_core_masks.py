"""Every mask kind against a double loop over the definitions, torch.tril/triu, and FlexAttention's create_mask."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

from maskcli.conventions import to_convention
from maskcli.masks import build
from maskcli.spec import make_spec


def loop(spec_kind, q_len, k_len, offset=0, *, valid=None, batch=1, rule):
    """keep[b][i][j] by a plain double loop; rule(q, kv) takes absolute positions."""
    return [
        [[bool(rule(offset + i, j)) and (valid is None or valid[b][j]) for j in range(k_len)] for i in range(q_len)]
        for b in range(batch)
    ]


def dense(spec):
    keep = build(spec).dense()
    assert keep.dtype == torch.bool and tuple(keep.shape) == spec.shape
    return keep


def check(spec, rule, valid=None):
    keep = dense(spec)
    expected = loop(spec.kind, spec.q_len, spec.k_len, spec.offset, valid=valid, batch=spec.batch, rule=rule)
    for b in range(spec.batch):
        for h in range(spec.heads):
            assert keep[b, h].tolist() == expected[b], (spec, b, h)
    # FlexAttention evaluates the same predicate its own way (vmap over scalar indices).
    flex = create_mask(build(spec).mask_mod, spec.batch, spec.heads, spec.q_len, spec.k_len, device="cpu")
    assert torch.equal(flex, keep)


sizes = st.integers(min_value=1, max_value=12)


@settings(max_examples=40, deadline=None)
@given(length=sizes, heads=st.integers(1, 3))
def test_causal(length, heads):
    check(make_spec("causal", length=length, heads=heads), lambda q, kv: kv <= q)
    assert torch.equal(dense(make_spec("causal", length=length))[0, 0], torch.tril(torch.ones(length, length, dtype=torch.bool)))


@settings(max_examples=40, deadline=None)
@given(length=sizes, diagonal=st.integers(-4, 4), means=st.sampled_from(["keep", "block"]))
def test_tril_triu_are_the_raw_torch_matrices(length, diagonal, means):
    ones = torch.ones(length, length)
    tril = dense(make_spec("tril", length=length, diagonal=diagonal, means=means))[0, 0]
    triu = dense(make_spec("triu", length=length, diagonal=diagonal, means=means))[0, 0]
    raw_tril = torch.tril(ones, diagonal).bool()
    raw_triu = torch.triu(ones, diagonal).bool()
    assert torch.equal(tril, raw_tril if means == "keep" else ~raw_tril)
    assert torch.equal(triu, raw_triu if means == "keep" else ~raw_triu)


def test_tril_triu_defaults_are_the_tutorial_causal_mask():
    causal = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    assert torch.equal(dense(make_spec("tril", length=5))[0, 0], causal)  # tril(ones) read as keep
    assert torch.equal(dense(make_spec("triu", length=5))[0, 0], causal)  # triu(ones, 1) read as block


@settings(max_examples=40, deadline=None)
@given(data=st.data(), length=sizes)
def test_padding_from_lengths_and_from_ids(data, length):
    lengths = data.draw(st.lists(st.integers(0, length), min_size=1, max_size=3))
    spec = make_spec("padding", length=length, lengths=",".join(map(str, lengths)))
    valid = [[j < n for j in range(length)] for n in lengths]
    check(spec, lambda q, kv: True, valid)

    ids = data.draw(st.lists(st.lists(st.integers(0, 3), min_size=length, max_size=length), min_size=1, max_size=3))
    spec = make_spec("padding", ids=";".join(",".join(map(str, row)) for row in ids), pad_id=0)
    check(spec, lambda q, kv: True, [[token != 0 for token in row] for row in ids])


@settings(max_examples=40, deadline=None)
@given(offset=st.integers(0, 10), length=sizes)
def test_prefill_is_bottom_right_causal(offset, length):
    spec = make_spec("prefill", offset=offset, length=length)
    assert (spec.q_len, spec.k_len) == (length, offset + length)
    check(spec, lambda q, kv: kv <= q)
    # same as torch.tril with the diagonal moved right by the cache length
    assert torch.equal(dense(spec)[0, 0], torch.ones(length, offset + length).tril(offset).bool())


@settings(max_examples=40, deadline=None)
@given(labels=st.lists(st.integers(0, 4), min_size=1, max_size=12))
def test_chunk_and_document(labels):
    text = ",".join(map(str, labels))
    check(make_spec("chunk", chunks=text), lambda q, kv: labels[kv] <= labels[q])
    check(make_spec("document", chunks=text), lambda q, kv: labels[kv] == labels[q] and kv <= q)


@settings(max_examples=40, deadline=None)
@given(length=sizes, window=st.integers(1, 14))
def test_window_counts_w_keys_including_itself(length, window):
    spec = make_spec("window", length=length, window=window)
    check(spec, lambda q, kv: kv <= q and q - kv < window)
    assert dense(spec)[0, 0, -1].sum().item() == min(window, length)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), length=sizes)
def test_prefix(data, length):
    prefix = data.draw(st.integers(1, length))
    check(make_spec("prefix", length=length, prefix=prefix), lambda q, kv: kv <= q or (q < prefix and kv < prefix))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["causal", "window", "prefix", "prefill"]), length=sizes)
def test_padding_combines_with_other_kinds(data, kind, length):
    extra = {"window": {"window": 2}, "prefix": {"prefix": 1}, "prefill": {"offset": 2}}.get(kind, {})
    k_len = length + extra.get("offset", 0)
    lengths = data.draw(st.lists(st.integers(0, k_len), min_size=1, max_size=3))
    spec = make_spec(kind, length=length, lengths=",".join(map(str, lengths)), **extra)
    rule = {
        "causal": lambda q, kv: kv <= q,
        "window": lambda q, kv: kv <= q and q - kv < 2,
        "prefix": lambda q, kv: kv <= q or kv < 1,
        "prefill": lambda q, kv: kv <= q,
    }[kind]
    check(spec, rule, [[j < n for j in range(k_len)] for n in lengths])


def test_and_or_compose_like_flex_attention():
    causal = build(make_spec("causal", length=6))
    window = build(make_spec("window", length=6, window=2))
    prefix = build(make_spec("prefix", length=6, prefix=3))
    assert torch.equal((causal & window).dense(), window.dense())
    assert torch.equal((window | prefix).dense(), window.dense() | prefix.dense())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_conventions(dtype):
    keep = dense(make_spec("causal", length=4))
    assert torch.equal(to_convention(keep, "keep"), keep)
    assert torch.equal(to_convention(keep, "block"), ~keep)
    assert to_convention(keep, "int").tolist() == keep.long().tolist()
    additive = to_convention(keep, "additive", dtype)
    assert additive.dtype == dtype and torch.equal(additive, torch.zeros(4, 4, dtype=dtype).masked_fill(~keep, float("-inf")))
    # the additive mask is what nn.Transformer builds for itself
    assert torch.equal(additive[0, 0].float(), torch.nn.Transformer.generate_square_subsequent_mask(4))
    minimum = to_convention(keep, "min", dtype)
    assert minimum[~keep].unique().tolist() == [torch.finfo(dtype).min] and bool((minimum[keep] == 0).all())


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 40), rows=st.integers(1, 9), cols=st.integers(1, 9), window=st.integers(1, 6))
def test_block_shares_count_exactly_when_blocks_are_small(length, rows, cols, window):
    from maskcli.masks import block_shares

    mask = build(make_spec("window", length=length, window=window))
    shares, sampled = block_shares(mask, 0, 0, rows, cols)
    keep = mask.dense()[0, 0].double()
    for i in range(shares.shape[0]):
        for j in range(shares.shape[1]):
            block = keep[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
            assert shares[i, j].item() == pytest.approx(block.mean().item())
    assert not sampled


def test_block_shares_of_a_huge_mask_are_sampled_and_right_where_it_is_clear():
    from maskcli.masks import block_shares

    length = 10**12
    mask = build(make_spec("causal", length=length))
    block = length // 10
    shares, sampled = block_shares(mask, 0, 0, block, block)
    assert sampled and shares.shape == (10, 10)
    for i in range(10):
        for j in range(10):
            expected = 1.0 if j < i else 0.0 if j > i else None  # diagonal blocks are about half visible
            if expected is None:
                assert 0.4 < shares[i, j].item() < 0.6
            else:
                assert shares[i, j].item() == expected
