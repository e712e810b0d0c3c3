"""Masks from expressions, on absolute positions: intervals = predicate = the double-loop definitions.

Random trees of &, |, ~ over random kinds and parameters, behind random offsets and kv
windows, with key padding and per-batch-row labels, are built through maskcli and compared
cell for cell with tests/definitions.py; FlexAttention's create_mask with the exported
mask_mod must agree too.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import definitions as ref
from maskcli.errors import MaskError
from maskcli.mask import MaskOptions, mask


@st.composite
def positions(draw):
    """Options that place the queries and keys, and the frame the issue's rules give for them."""
    lq = draw(st.integers(1, 6))
    offset = draw(st.one_of(st.none(), st.integers(0, 5)))
    kv_len = draw(st.one_of(st.none(), st.integers(1, 9)))
    kv_start = draw(st.one_of(st.none(), st.integers(0, 4)))
    align = draw(st.sampled_from([None, "top-left", "bottom-right"])) if kv_len is not None and offset is None else None
    k0 = kv_start or 0
    if kv_len is None:
        q0 = offset or 0
        k1 = q0 + lq
    else:
        k1 = k0 + kv_len
        q0 = offset if offset is not None else (k1 - lq if align == "bottom-right" else k0)
    if k1 <= k0 or q0 < 0:
        kv_start, k0, align = None, 0, None
        q0 = offset or 0
        kv_len = None
        k1 = q0 + lq
    options = dict(length=lq, offset=offset, kv_start=kv_start, kv_len=kv_len, align=align)
    return options, (q0, lq, k0, k1 - k0)


def labels(n, rows, low, high):
    return st.lists(st.lists(st.integers(low, high), min_size=n, max_size=n), min_size=rows, max_size=rows)


@st.composite
def leaves(draw, n, lq, batch, padded):
    names = ["full", "causal", "window", "prefix", "sink", "local", "tril", "triu", "chunk", "document", "segment", "blocks", "tree"]
    if padded:
        names.append("padding")
    name = draw(st.sampled_from(names))
    rows = draw(st.sampled_from([1, batch]))
    if name in ("full", "causal", "padding"):
        return ("kind", name, {})
    if name == "window":
        return ("kind", name, {"window": draw(st.integers(1, 5))})
    if name in ("prefix", "sink"):
        return ("kind", name, {name: draw(st.integers(1, n))})
    if name == "local":
        return ("kind", name, {"chunk_size": draw(st.integers(1, 4))})
    if name in ("tril", "triu"):
        return ("kind", name, {"diagonal": draw(st.integers(-3, 3)), "means": draw(st.sampled_from(["keep", "block"]))})
    if name == "chunk" and draw(st.booleans()):  # non-decreasing labels: one interval per row
        return ("kind", name, {"labels": [sorted(row) for row in draw(labels(n, rows, 0, 3))]})
    if name in ("chunk", "document", "segment"):
        return ("kind", name, {"labels": draw(labels(n, rows, 0, 2))})
    if name == "blocks":
        return ("kind", name, {"labels": draw(labels(n, rows, -1, 2))})
    parents = [draw(st.integers(-1, i - 1)) for i in range(lq)]
    return ("kind", "tree", {"parents": parents})


@st.composite
def cases(draw):
    options, frame = draw(positions())
    q0, lq, k0, lk = frame
    n = max(q0 + lq, k0 + lk)
    batch = draw(st.integers(1, 2))
    padding = draw(st.sampled_from(["none", "lengths", "ids"]))
    valid = None
    if padding == "lengths":
        lengths = draw(st.lists(st.integers(0, n), min_size=batch, max_size=batch))
        options["lengths"] = ",".join(map(str, lengths))
        valid = [[kv < length for kv in range(n)] for length in lengths]
    elif padding == "ids":
        ids = draw(st.lists(st.lists(st.sampled_from([0, 7, 8]), min_size=n, max_size=n), min_size=batch, max_size=batch))
        options["ids"] = ";".join(",".join(map(str, row)) for row in ids)
        valid = [[token != 0 for token in row] for row in ids]
    else:
        batch = draw(st.sampled_from([1, batch]))  # labels alone may set the batch
    tree = draw(st.recursive(
        leaves(n, lq, batch, valid is not None),
        lambda inner: st.one_of(
            inner.map(lambda t: ("not", t)),
            st.lists(inner, min_size=2, max_size=3).map(lambda ts: ("and", ts)),
            st.lists(inner, min_size=2, max_size=3).map(lambda ts: ("or", ts)),
        ),
        max_leaves=4,
    ))
    return tree, options, frame, valid


def reference_for(tree, frame, valid, batch):
    q0, lq, k0, lk = frame
    left = [ref.left_padding(row) for row in valid] if valid is not None and True else None
    return np.array(ref.dense(tree, q0=q0, lq=lq, k0=k0, lk=lk, batch=batch, valid=valid, ids_valid_left_pad=left))


def uses_ids(options):
    return options.get("ids") is not None


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_random_expressions_equal_the_definitions(case):
    tree, options, frame, valid = case
    built = mask(ref.text(tree), MaskOptions(**options))
    assert (built.frame.q_start, built.frame.q_len, built.frame.k_start, built.frame.k_len) == frame
    assert built.q_offset == frame[0] and built.kv_offset == frame[2]
    batch = built.batch
    left = [ref.left_padding(row) for row in valid] if uses_ids(options) else [0] * batch
    expected = np.array(ref.dense(tree, q0=frame[0], lq=frame[1], k0=frame[2], lk=frame[3], batch=batch, valid=valid, ids_valid_left_pad=left))
    cells = np.broadcast_to(built.dense()[:, 0], expected.shape)
    assert np.array_equal(cells, expected)  # from the intervals where they are few, else the predicate
    assert np.array_equal(built.materialize().numpy()[:, 0], expected)  # the predicate on absolute positions
    if built.exact:
        intervals = built.intervals()
        counts = np.broadcast_to(intervals.counts(), expected.shape[:2])
        assert np.array_equal(counts, expected.sum(-1))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_flex_create_mask_with_the_exported_mask_mod_agrees(case):
    from torch.nn.attention.flex_attention import create_mask

    tree, options, frame, valid = case
    built = mask(ref.text(tree), MaskOptions(**options))
    flex = create_mask(built.mask_mod, built.batch, 1, frame[1], frame[3], device="cpu")
    assert np.array_equal(flex.numpy()[:, 0], np.broadcast_to(built.dense()[:, 0], flex.shape[:1] + flex.shape[2:]))


def test_the_issue_compositions():
    cases = {
        "document(0,0,0,1,1,1) & window(2)": [
            [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1],
        ],
        "causal | blocks(-1,-1,0,0,0,-1)": [
            [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1],
        ],
    }
    for text, expected in cases.items():
        assert mask(text).dense()[0, 0].astype(int).tolist() == expected
    sinks = mask("causal & (window(3) | sink(1))", length=6).dense()[0, 0].astype(int)
    assert sinks[5].tolist() == [1, 0, 0, 1, 1, 1]
    assert mask("~triu(1)", length=3).dense()[0, 0].astype(int).tolist() == [[0, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert mask("document(sizes=[3,5])").json()["params"]["labels"] == [0, 0, 0, 1, 1, 1, 1, 1]


def test_behind_a_cache_every_kind_uses_absolute_positions():
    # the decode step of a window: query 9 sees keys 7, 8, 9
    decode = mask("window(3)", offset=9, length=1)
    assert decode.intervals().row(0, 0) == [(7, 10)]
    # a sliding cache that dropped keys 0..5: the same window, fewer keys
    sliding = mask("window(3)", offset=9, length=1, kv_start=6)
    assert sliding.shape == (1, 1, 1, 4) and sliding.intervals().row(0, 0) == [(7, 10)]
    assert sliding.dense()[0, 0, 0].tolist() == [False, True, True, True]
    # a static cache of 8 keys with 3 queries: top-left by default, bottom-right on request
    assert mask("causal", length=3, kv_len=8).intervals().row(0, 2) == [(0, 3)]
    assert mask("causal", length=3, kv_len=8, align="bottom-right").intervals().row(0, 0) == [(0, 6)]
    # document labels indexed by absolute position, behind an offset
    behind = mask("document(0,0,1,1,1)", offset=3)
    assert behind.shape == (1, 1, 2, 5) and behind.dense()[0, 0].astype(int).tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


def test_llama4_local_attention_counts_chunks_from_the_first_real_token():
    # Hugging Face's chunked_overlay with left padding: (kv - pad) // C == (q - pad) // C, and causal
    left_padded = mask("local(3)", ids="0,0,5,6,7,8,9,1")
    cells = left_padded.dense()[0, 0].astype(int)
    assert cells[4].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]  # tokens 2, 3, 4 are the first chunk
    assert cells[5].tolist() == [0, 0, 0, 0, 0, 1, 0, 0]  # token 5 starts the second
    plain = mask("local(3)", length=8).dense()[0, 0].astype(int)
    assert plain[5].tolist() == [0, 0, 0, 1, 1, 1, 0, 0]


def test_tree_sees_the_prefix_its_ancestors_and_itself():
    drafted = mask("tree(-1,0,0,1)", offset=3)
    assert drafted.shape == (1, 1, 4, 7)
    assert drafted.dense()[0, 0].astype(int).tolist() == [
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 1, 0],
        [1, 1, 1, 1, 1, 0, 1],
    ]
    with pytest.raises(MaskError, match=r"parents\[1\] is 1"):
        mask("tree(-1,1)")
    with pytest.raises(MaskError, match="does not match the 4 draft tokens"):
        mask("tree(-1,0,0,1)", length=3)


def test_labels_that_do_not_stay_few_fall_back_to_the_predicate():
    down = mask("chunk(0,0,1,1,0,2)")
    assert not down.exact and "go down at position 4" in down.why_not_exact
    assert down.dense()[0, 0, 4].astype(int).tolist() == [1, 1, 0, 0, 1, 0]
    assert any("go down" in warning for warning in down.warnings)
    scattered = mask("segment(" + ",".join(str(i % 2) for i in range(140)) + ")")
    assert not scattered.exact and "separate runs" in scattered.why_not_exact


def test_bare_kinds_take_their_parameters_from_flags():
    assert mask("window", length=6, params={"--window": 2}).text == "window(2)"
    assert mask("document & window", params={"--chunks": "0,0,1,1", "--window": 2}).text == "document(0,0,1,1) & window(2)"
    assert mask("document", params={"--sizes": "2,2"}).text == "document(sizes=[2,2])"
    assert mask("prefill", offset=4, length=2).text == "causal"
    assert mask("triu", length=3, params={"--means": "keep"}).text == "triu(1, means=keep)"


@pytest.mark.parametrize(
    ("text", "options", "says"),
    [
        ("causal", {"params": {"--window": 3}}, "--window 3 does not apply to 'causal': it is for window"),
        ("window(4)", {"params": {"--window": 3}}, "--window 3 does not apply: window(4) in the expression gives its own"),
        ("window", {}, "window needs --window W"),
        ("window(0)", {}, "window(0): window must be at least 1"),
        ("tril(1, 2)", {}, "diagonal is one whole number"),
        ("causal(3)", {}, "causal takes no parameters"),
        ("window(size=3)", {}, "window has no parameter 'size'"),
        ("windw(3)", {}, "did you mean window?"),
        ("tril(means=maybe)", {}, "means must be one of keep, block"),
        ("chunk(0,0,1)", {"length": 5}, "have 3 entries but the mask covers positions 0-4"),
        ("document(0,1;0,1;1,1)", {"lengths": "2,1"}, "batch rows do not agree"),
        ("padding", {}, "needs --lengths"),
        ("sink(9)", {"length": 4}, "more than the sequence's 4 positions"),
        ("causal", {"kv_start": 5, "length": 3}, "--kv-start 5 leaves no key"),
        ("causal", {"align": "bottom-right"}, "without --kv-len"),
        ("causal", {"kv_len": 2, "length": 4, "align": "bottom-right"}, "first query would sit at position -2"),
        ("causal", {"lengths": "4,9", "length": 4}, "length 9 in --lengths is larger than the sequence"),
        ("document(sizes=[3,0])", {}, "segment sizes must be at least 1"),
        ('document("missing.npy")', {}, "no such file 'missing.npy'"),
    ],
)
def test_bad_expressions_and_options_say_what_to_fix(text, options, says):
    with pytest.raises(MaskError) as error:
        mask(text, MaskOptions(**options))
    assert says in str(error.value)


def test_labels_from_files(tmp_path):
    np.save(tmp_path / "labels.npy", np.array([0, 0, 1, 1, 1]))
    (tmp_path / "labels.json").write_text("[[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]")
    (tmp_path / "labels.txt").write_text("0 0 1 1 1\n")
    import torch

    torch.save(torch.tensor([0, 0, 1, 1, 1]), tmp_path / "labels.pt")
    expected = mask("document(0,0,1,1,1)").dense()
    for name in ("labels.npy", "labels.txt", "labels.pt"):
        from_file = mask(f'document("{tmp_path / name}")')
        assert np.array_equal(from_file.dense(), expected)
        assert from_file.text == f'document("{tmp_path / name}")'
    two = mask(f'document("{tmp_path / "labels.json"}")')
    assert two.batch == 2 and two.dense()[1, 0, 1].astype(int).tolist() == [0, 1, 0, 0, 0]
    assert np.array_equal(mask("document", params={"--chunks": str(tmp_path / "labels.npy")}).dense(), expected)


def test_a_million_token_mask_is_intervals_not_cells():
    sizes = ",".join(["4096"] * 256)
    long = mask(f"document(sizes=[{sizes}]) & window(4096)")
    intervals = long.intervals()
    assert long.shape == (1, 1, 1 << 20, 1 << 20) and intervals.per_row == 1
    # closed form: each document of 4096 is causal inside, and a 4096 window never cuts it
    assert int(intervals.counts().sum()) == 256 * 4096 * 4097 // 2
    assert intervals.row(0, 5000) == [(4096, 5001)]
