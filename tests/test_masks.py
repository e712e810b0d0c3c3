"""The mask library against independent references.

Each kind's dense mask is compared with a double loop over the definition (tests/reference.py),
with torch.tril/torch.triu where the kind is one, and with FlexAttention's own
`create_mask`, which evaluates the same predicate its own way (vmap over scalar indices).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import and_masks as flex_and_masks
from torch.nn.attention.flex_attention import create_mask
from torch.nn.attention.flex_attention import or_masks as flex_or_masks

from maskcli import masks
from maskcli.conventions import bytes_per_cell, to_convention
from maskcli.errors import MaskError
from maskcli.masks import and_masks, build, or_masks
from maskcli.spec import make_spec
from reference import reference, valid_from_ids, valid_from_lengths

FAST = settings(max_examples=50, deadline=None)
sizes = st.integers(min_value=1, max_value=10)
labels_st = st.lists(st.integers(-2, 4), min_size=1, max_size=10)


def check(spec, expected):
    """dense() is bool (B, H, Lq, Lk), equals `expected` and FlexAttention's create_mask."""
    mask = build(spec)
    keep = mask.dense()
    assert keep.dtype == torch.bool
    assert tuple(keep.shape) == spec.shape == (len(expected), len(expected[0]), len(expected[0][0]), len(expected[0][0][0]))
    assert keep.tolist() == expected, spec
    batch, heads, q_len, k_len = spec.shape
    flex = create_mask(mask.mask_mod, batch, heads, q_len, k_len, device="cpu")
    assert torch.equal(flex, keep), spec
    return keep


# --- every kind alone ----------------------------------------------------------------


@FAST
@given(length=sizes, heads=st.integers(1, 3))
def test_causal(length, heads):
    keep = check(make_spec("causal", length=length, heads=heads), reference("causal", length, length, heads=heads))
    assert torch.equal(keep[0, 0], torch.tril(torch.ones(length, length)).bool())


@FAST
@given(length=sizes, diagonal=st.integers(-5, 5), means=st.sampled_from([None, "keep", "block"]))
def test_tril(length, diagonal, means):
    spec = make_spec("tril", length=length, diagonal=diagonal, means=means)
    keep = check(spec, reference("tril", length, length, diagonal=diagonal, means=means))
    raw = torch.tril(torch.ones(length, length), diagonal).bool()
    # tril is read as keep unless told otherwise
    assert torch.equal(keep[0, 0], raw if means in (None, "keep") else ~raw)


@FAST
@given(length=sizes, diagonal=st.integers(-5, 5), means=st.sampled_from([None, "keep", "block"]))
def test_triu(length, diagonal, means):
    spec = make_spec("triu", length=length, diagonal=diagonal, means=means)
    keep = check(spec, reference("triu", length, length, diagonal=diagonal, means=means))
    raw = torch.triu(torch.ones(length, length), diagonal).bool()
    # triu is read as block unless told otherwise: its 1-cells are the masked ones
    assert torch.equal(keep[0, 0], raw if means == "keep" else ~raw)


@pytest.mark.parametrize("length", [1, 2, 5, 9])
def test_tril_and_triu_defaults_both_give_the_tutorial_causal_mask(length):
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    assert torch.equal(build(make_spec("tril", length=length)).dense()[0, 0], causal)
    assert torch.equal(build(make_spec("triu", length=length)).dense()[0, 0], causal)
    # the llama idiom: triu(full(-inf), 1) added to the scores is the causal mask in the additive convention
    llama = torch.triu(torch.full((length, length), float("-inf")), 1)
    assert torch.equal(to_convention(build(make_spec("triu", length=length)).dense(), "additive")[0, 0], llama)


@FAST
@given(data=st.data(), length=sizes)
def test_padding_from_lengths(data, length):
    lengths = data.draw(st.lists(st.integers(0, length), min_size=1, max_size=3))
    spec = make_spec("padding", length=length, lengths=",".join(map(str, lengths)))
    check(spec, reference("padding", length, length, valid=valid_from_lengths(lengths, length)))


@FAST
@given(data=st.data())
def test_padding_lengths_without_len_use_the_longest(data):
    lengths = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=3))
    assume(max(lengths) > 0)
    spec = make_spec("padding", lengths=",".join(map(str, lengths)))
    longest = max(lengths)
    check(spec, reference("padding", longest, longest, valid=valid_from_lengths(lengths, longest)))


@FAST
@given(data=st.data(), length=sizes, pad_id=st.integers(-1, 3))
def test_padding_from_ids(data, length, pad_id):
    ids = data.draw(st.lists(st.lists(st.integers(-1, 3), min_size=length, max_size=length), min_size=1, max_size=3))
    spec = make_spec("padding", ids=";".join(",".join(map(str, row)) for row in ids), pad_id=pad_id)
    check(spec, reference("padding", length, length, valid=valid_from_ids(ids, pad_id)))


@FAST
@given(offset=st.integers(0, 10), length=sizes)
def test_prefill(offset, length):
    spec = make_spec("prefill", offset=offset, length=length)
    assert (spec.q_len, spec.k_len, spec.offset) == (length, offset + length, offset)
    # written with local rows: query i sits at absolute position offset + i and sees kv <= offset + i
    expected = [[[[kv <= offset + i for kv in range(offset + length)] for i in range(length)]]]
    keep = check(spec, expected)
    assert build(spec).q_offset == offset
    # bottom-right aligned: torch.tril of the (Lq, Lk) ones moved right by the cache length
    assert torch.equal(keep[0, 0], torch.ones(length, offset + length).tril(offset).bool())


def test_decode_step_sees_every_cached_key():
    keep = build(make_spec("prefill", offset=7, length=1)).dense()
    assert keep.shape == (1, 1, 1, 8) and bool(keep.all())


@FAST
@given(labels=labels_st)
def test_chunk(labels):
    spec = make_spec("chunk", chunks=",".join(map(str, labels)))
    check(spec, reference("chunk", len(labels), len(labels), labels=labels))


@FAST
@given(length=sizes, window=st.integers(1, 12))
def test_window(length, window):
    spec = make_spec("window", length=length, window=window)
    keep = check(spec, reference("window", length, length, window=window))
    # W keys in all, itself included, once the row is far enough in
    assert keep[0, 0].sum(dim=1).tolist() == [min(window, q + 1) for q in range(length)]


@FAST
@given(data=st.data(), length=sizes)
def test_prefix(data, length):
    prefix = data.draw(st.integers(1, length))
    spec = make_spec("prefix", length=length, prefix=prefix)
    check(spec, reference("prefix", length, length, prefix=prefix))


@FAST
@given(labels=labels_st)
def test_document(labels):
    spec = make_spec("document", chunks=",".join(map(str, labels)))
    check(spec, reference("document", len(labels), len(labels), labels=labels))


# --- padding with every other kind ---------------------------------------------------


def kind_options(data, kind):
    """Random options for `kind` as make_spec takes them, and the reference's parameters."""
    if kind in ("chunk", "document"):
        labels = data.draw(labels_st)
        return {"chunks": ",".join(map(str, labels))}, {"labels": labels}, len(labels), 0
    length = data.draw(sizes)
    if kind in ("tril", "triu"):
        diagonal = data.draw(st.integers(-3, 3))
        means = data.draw(st.sampled_from(["keep", "block"]))
        return {"length": length, "diagonal": diagonal, "means": means}, {"diagonal": diagonal, "means": means}, length, 0
    if kind == "prefill":
        offset = data.draw(st.integers(0, 6))
        return {"length": length, "offset": offset}, {}, length, offset
    if kind == "window":
        window = data.draw(st.integers(1, 12))
        return {"length": length, "window": window}, {"window": window}, length, 0
    if kind == "prefix":
        prefix = data.draw(st.integers(1, length))
        return {"length": length, "prefix": prefix}, {"prefix": prefix}, length, 0
    return {"length": length}, {}, length, 0


@FAST
@given(data=st.data(), kind=st.sampled_from(["causal", "tril", "triu", "prefill", "chunk", "window", "prefix", "document"]),
       heads=st.integers(1, 2))
def test_padding_combines_with_every_kind(data, kind, heads):
    options, params, q_len, offset = kind_options(data, kind)
    k_len = q_len + offset
    if data.draw(st.booleans()):
        lengths = data.draw(st.lists(st.integers(0, k_len), min_size=1, max_size=3))
        spec = make_spec(kind, lengths=",".join(map(str, lengths)), heads=heads, **options)
        valid = valid_from_lengths(lengths, k_len)
    else:
        ids = data.draw(st.lists(st.lists(st.integers(0, 2), min_size=k_len, max_size=k_len), min_size=1, max_size=3))
        spec = make_spec(kind, ids=";".join(",".join(map(str, row)) for row in ids), pad_id=0, heads=heads, **options)
        valid = valid_from_ids(ids, 0)
    check(spec, reference(kind, q_len, k_len, offset, valid=valid, heads=heads, **params))


def test_causal_plus_padding_is_the_merged_decoder_mask():
    keep = build(make_spec("causal", length=4, lengths="4,2")).dense()
    assert keep[:, 0].int().tolist() == [
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]],
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]],
    ]
    # the same as the usual recipe: tril(ones) & key_padding[:, None, None, :]
    lengths = torch.tensor([4, 2])
    key_valid = torch.arange(4)[None, :] < lengths[:, None]
    recipe = torch.tril(torch.ones(4, 4, dtype=torch.bool))[None, None] & key_valid[:, None, None, :]
    assert torch.equal(keep, recipe)


# --- Mask: materialise windows, combine --------------------------------------------


@FAST
@given(data=st.data(), kind=st.sampled_from(["causal", "window", "prefill", "chunk", "document", "prefix", "tril"]))
def test_materialize_a_window_is_that_slice_of_the_whole(data, kind):
    options, params, q_len, offset = kind_options(data, kind)
    mask = build(make_spec(kind, **options))
    k_len = q_len + offset
    q0 = data.draw(st.integers(0, q_len - 1))
    q1 = data.draw(st.integers(q0 + 1, q_len))
    k0 = data.draw(st.integers(0, k_len - 1))
    k1 = data.draw(st.integers(k0 + 1, k_len))
    expected = reference(kind, q_len, k_len, offset, **params)[0][0]
    window = mask.materialize(range(q0, q1), range(k0, k1))
    assert window.shape == (1, 1, q1 - q0, k1 - k0)
    assert window[0, 0].tolist() == [row[k0:k1] for row in expected[q0:q1]]


def test_predicate_builders_are_flex_attention_mask_mods():
    # the raw builders, without a spec: hand them to create_mask and compare with the loops
    length = 7
    for mask_mod, kind, params in [
        (masks.causal(), "causal", {}),
        (masks.tril(1), "tril", {"diagonal": 1, "means": "keep"}),
        (masks.triu(2), "triu", {"diagonal": 2, "means": "keep"}),
        (masks.sliding_window(3), "window", {"window": 3}),
        (masks.prefix_lm(2), "prefix", {"prefix": 2}),
        (masks.chunked(torch.tensor([0, 0, 1, 1, 1, 2, 3])), "chunk", {"labels": [0, 0, 1, 1, 1, 2, 3]}),
        (masks.document(torch.tensor([0, 0, 1, 1, 1, 2, 3])), "document", {"labels": [0, 0, 1, 1, 1, 2, 3]}),
    ]:
        got = create_mask(mask_mod, 1, 1, length, length, device="cpu")
        assert got.tolist() == reference(kind, length, length, **params), kind
    prefill = create_mask(masks.bottom_right_causal(3), 1, 1, 2, 5, device="cpu")
    assert prefill.tolist() == reference("prefill", 2, 5, 3)


PAIRS = st.sampled_from(["causal", "window", "prefix", "tril", "triu"])


def _spec_and_params(kind, length, draw):
    if kind == "window":
        window = draw(st.integers(1, length + 1))
        return make_spec(kind, length=length, window=window), {"window": window}
    if kind == "prefix":
        prefix = draw(st.integers(1, length))
        return make_spec(kind, length=length, prefix=prefix), {"prefix": prefix}
    if kind in ("tril", "triu"):
        diagonal = draw(st.integers(-2, 2))
        return make_spec(kind, length=length, diagonal=diagonal, means="keep"), {"diagonal": diagonal, "means": "keep"}
    return make_spec(kind, length=length), {}


@FAST
@given(data=st.data(), length=sizes, first=PAIRS, second=PAIRS)
def test_and_or_of_masks_are_elementwise(data, length, first, second):
    spec_a, params_a = _spec_and_params(first, length, data.draw)
    spec_b, params_b = _spec_and_params(second, length, data.draw)
    a, b = build(spec_a), build(spec_b)
    ref_a = reference(first, length, length, **params_a)[0][0]
    ref_b = reference(second, length, length, **params_b)[0][0]
    both = [[x and y for x, y in zip(ra, rb)] for ra, rb in zip(ref_a, ref_b)]
    either = [[x or y for x, y in zip(ra, rb)] for ra, rb in zip(ref_a, ref_b)]

    assert (a & b).dense()[0, 0].tolist() == both
    assert (a | b).dense()[0, 0].tolist() == either
    assert (a & b).name == f"{a.name}_and_{b.name}" and (a | b).name == f"{a.name}_or_{b.name}"
    for ours, theirs, expected in [(and_masks, flex_and_masks, both), (or_masks, flex_or_masks, either)]:
        mine = create_mask(ours(a.mask_mod, b.mask_mod), 1, 1, length, length, device="cpu")
        flex = create_mask(theirs(a.mask_mod, b.mask_mod), 1, 1, length, length, device="cpu")
        assert mine[0, 0].tolist() == expected
        assert torch.equal(mine, flex)


def test_and_masks_of_three_and_with_padding():
    length = 6
    causal = build(make_spec("causal", length=length))
    window = build(make_spec("window", length=length, window=3))
    padded = build(make_spec("padding", length=length, lengths="5,2"))
    combined = causal & window & padded
    assert combined.shape == (2, 1, length, length)
    expected = reference("window", length, length, window=3, valid=valid_from_lengths([5, 2], length))
    assert combined.dense().tolist() == expected
    three = and_masks(causal.mask_mod, window.mask_mod, padded.mask_mod)
    assert create_mask(three, 2, 1, length, length, device="cpu").tolist() == expected


def test_combining_masks_of_different_lengths_or_offsets_is_refused():
    with pytest.raises(MaskError, match="query and key lengths must match"):
        build(make_spec("causal", length=4)) & build(make_spec("causal", length=5))
    with pytest.raises(MaskError):
        build(make_spec("prefill", offset=1, length=3)) | build(make_spec("prefill", offset=2, length=2))


def test_combining_masks_whose_batches_do_not_broadcast_is_refused():
    two = build(make_spec("padding", length=4, lengths="4,2"))
    three = build(make_spec("padding", length=4, lengths="4,3,1"))
    with pytest.raises(MaskError, match="batch"):
        two & three
    # batch 1 broadcasts against any batch
    assert (build(make_spec("causal", length=4)) & three).dense().shape == (3, 1, 4, 4)


def test_mask_is_immutable():
    mask = build(make_spec("causal", length=3))
    with pytest.raises(AttributeError):
        mask.shape = (1, 1, 9, 9)


# --- conventions -------------------------------------------------------------------


keep_tensors = st.integers(1, 6).flatmap(
    lambda n: st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=1, max_size=6)
).map(lambda rows: torch.tensor(rows, dtype=torch.bool))


@FAST
@given(keep=keep_tensors, dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]))
def test_every_convention(keep, dtype):
    cells = [(i, j) for i in range(keep.shape[0]) for j in range(keep.shape[1])]
    visible = {cell for cell in cells if keep[cell]}

    same = to_convention(keep, "keep")
    assert same.dtype == torch.bool and torch.equal(same, keep)
    same[...] = ~same  # a copy: changing it leaves the mask alone
    assert not torch.equal(same, keep)

    block = to_convention(keep, "block")
    assert block.dtype == torch.bool
    assert all(bool(block[cell]) == (cell not in visible) for cell in cells)

    integer = to_convention(keep, "int")
    assert not integer.is_floating_point() and integer.dtype != torch.bool
    assert all(int(integer[cell]) == (1 if cell in visible else 0) for cell in cells)

    additive = to_convention(keep, "additive", dtype)
    assert additive.dtype == dtype
    assert all(float(additive[cell]) == (0.0 if cell in visible else -math.inf) for cell in cells)

    lowest = to_convention(keep, "min", dtype)
    assert lowest.dtype == dtype
    assert bool(torch.isfinite(lowest).all())
    assert all(float(lowest[cell]) == (0.0 if cell in visible else torch.finfo(dtype).min) for cell in cells)

    for convention in ("keep", "block", "int", "additive", "min"):
        assert to_convention(keep, convention, dtype).element_size() == bytes_per_cell(convention, dtype)


@pytest.mark.parametrize("dtype, lowest", [(torch.float16, -65504.0), (torch.bfloat16, -3.3895313892515355e38),
                                           (torch.float32, -3.4028234663852886e38)])
def test_min_fill_is_the_lowest_finite_value_of_the_dtype(dtype, lowest):
    masked = to_convention(torch.tensor([[True, False]]), "min", dtype)
    assert masked[0, 1].item() == lowest and masked[0, 0].item() == 0


def test_additive_causal_is_what_nn_transformer_builds():
    keep = build(make_spec("causal", length=5)).dense()
    assert torch.equal(to_convention(keep, "additive")[0, 0], torch.nn.Transformer.generate_square_subsequent_mask(5))


def test_unknown_convention_is_refused():
    with pytest.raises(ValueError, match="sideways"):
        to_convention(torch.ones(2, 2, dtype=torch.bool), "sideways")


def test_conventions_mean_the_same_to_pytorch_attention():
    """keep, additive and min in SDPA, and block in nn.MultiheadAttention, all give the same output."""
    torch.manual_seed(0)
    keep = build(make_spec("window", length=6, window=3, lengths="6,4")).dense()  # (2, 1, 6, 6), every row sees a key
    q, k, v = (torch.randn(2, 1, 6, 4) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    want = sdpa(q, k, v, attn_mask=keep)
    # by hand: softmax over the visible keys only
    scores = (q @ k.transpose(-1, -2)) / 2.0
    by_hand = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v
    torch.testing.assert_close(want, by_hand)
    torch.testing.assert_close(sdpa(q, k, v, attn_mask=to_convention(keep, "additive")), want)
    torch.testing.assert_close(sdpa(q, k, v, attn_mask=to_convention(keep, "min")), want)
    mha = torch.nn.MultiheadAttention(4, 1, batch_first=True, bias=False)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([torch.eye(4)] * 3))
        mha.out_proj.weight.copy_(torch.eye(4))
    out, _ = mha(q[:, 0], k[:, 0], v[:, 0], attn_mask=to_convention(keep, "block")[:, 0], need_weights=False)
    torch.testing.assert_close(out, want[:, 0])


# --- the memory guard ----------------------------------------------------------------


def test_dense_refuses_what_does_not_fit(monkeypatch):
    monkeypatch.setattr(masks, "available_memory", lambda device=None: 1000)
    with pytest.raises(MaskError, match=r"1,024 bytes") as error:
        build(make_spec("causal", length=32)).dense()  # 32 x 32 bool cells
    assert "1 x 1 x 32 x 32" in str(error.value)
    assert build(make_spec("causal", length=31)).dense().shape == (1, 1, 31, 31)  # 961 bytes fits
    monkeypatch.setattr(masks, "available_memory", lambda device=None: None)  # the platform cannot say: go ahead
    assert build(make_spec("causal", length=32)).dense().shape == (1, 1, 32, 32)


@pytest.mark.parametrize("count, text", [(0, "0 bytes"), (1023, "1023 bytes"), (1024, "1.0 KiB"),
                                         (3 * 1024**3, "3.0 GiB"), (2**60, "1024.0 PiB")])
def test_format_bytes(count, text):
    assert masks.format_bytes(count) == text


@settings(max_examples=30, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["chunk", "prefix", "document", "prefill"]),
       rows=st.integers(1, 5), cols=st.integers(1, 5))
def test_block_shares_are_the_share_of_visible_cells_per_block(data, kind, rows, cols):
    options, params, q_len, offset = kind_options(data, kind)
    k_len = q_len + offset
    mask = build(make_spec(kind, **options))
    shares, sampled = masks.block_shares(mask, 0, 0, rows, cols)
    expected = reference(kind, q_len, k_len, offset, **params)[0][0]
    assert not sampled and shares.shape == (-(-q_len // rows), -(-k_len // cols))
    for r in range(shares.shape[0]):
        for c in range(shares.shape[1]):
            block = [expected[i][j] for i in range(r * rows, min(q_len, (r + 1) * rows))
                     for j in range(c * cols, min(k_len, (c + 1) * cols))]
            assert shares[r, c].item() == pytest.approx(sum(block) / len(block))


def test_block_shares_of_a_huge_mask_are_sampled_and_exact_away_from_the_diagonal():
    length = 10**12  # 10^24 cells: only ever sampled
    mask = build(make_spec("causal", length=length))
    block = length // 10
    shares, sampled = masks.block_shares(mask, 0, 0, block, block)
    assert sampled and shares.shape == (10, 10)
    for i in range(10):
        for j in range(10):
            if i == j:  # the causal diagonal block is about half visible
                assert 0.4 < shares[i, j].item() < 0.6
            else:
                assert shares[i, j].item() == (1.0 if j < i else 0.0)
