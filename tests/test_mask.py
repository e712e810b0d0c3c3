"""Masks from expressions, on absolute positions: intervals = predicate = the double-loop definitions.

Random trees of &, |, ~ over random kinds and parameters, behind random offsets and kv
windows, with key padding and per-batch-row labels, are built through maskcli and compared
cell for cell with tests/definitions.py; FlexAttention's create_mask with the exported
mask_mod must agree too.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import definitions as ref
from strategies import cases, expected_cells
from maskcli.errors import MaskError
from maskcli.mask import MaskOptions, build


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_random_expressions_equal_the_definitions(case):
    tree, options, frame, valid = case
    built = build(ref.text(tree), MaskOptions(**options))
    assert (built.frame.q_start, built.frame.q_len, built.frame.k_start, built.frame.k_len) == frame
    assert built.q_offset == frame[0] and built.kv_offset == frame[2]
    expected = expected_cells(tree, options, frame, valid, built.batch)
    cells = np.broadcast_to(built.dense()[:, 0], expected.shape)
    assert np.array_equal(cells, expected)  # from the intervals where they are few, else the predicate
    assert np.array_equal(built.materialize().numpy()[:, 0], expected)  # the predicate on absolute positions
    if built.exact:
        intervals = built.intervals()
        counts = np.broadcast_to(intervals.counts(), expected.shape[:2])
        assert np.array_equal(counts, expected.sum(-1))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases(), st.integers(0, 4))
def test_repeated_and_absorbed_terms_are_the_same_mask(case, form):
    """maskcli folds repeats before it evaluates (A & A, A | (A & B), ~~A): the cells stay the definitions'."""
    tree, options, frame, valid = case
    other = ("kind", "window", {"window": 2})
    repeated = [
        ("and", [tree, tree, tree]),
        ("or", [tree, ("and", [tree, other])]),
        ("and", [tree, ("or", [other, tree])]),
        ("not", ("not", tree)),
        ("and", [("or", [tree, tree]), ("and", [tree, tree])]),
    ][form]
    built = build(ref.text(repeated), MaskOptions(**options))
    expected = expected_cells(tree, options, frame, valid, built.batch)
    assert np.array_equal(np.broadcast_to(built.dense()[:, 0], expected.shape), expected)
    assert np.array_equal(built.materialize().numpy()[:, 0], expected)


def test_a_chain_of_one_term_is_evaluated_once(monkeypatch):
    from maskcli.intervals import Intervals

    combined = []
    for operator in ("__and__", "__or__"):
        real = getattr(Intervals, operator)
        monkeypatch.setattr(Intervals, operator, lambda a, b, real=real: combined.append(1) or real(a, b))
    n = 1 << 20
    built = build(" & ".join(["window(3)"] * 10_000), length=n)
    counts = built.intervals().counts()[0]
    assert combined == []  # no pass over the rows per term
    assert counts[:3].tolist() == [1, 2, 3] and (counts[2:] == 3).all() and counts.shape == (n,)
    assert built.text == " & ".join(["window(3)"] * 10_000)  # the name stays as written


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_flex_create_mask_with_the_exported_mask_mod_agrees(case):
    from torch.nn.attention.flex_attention import create_mask

    tree, options, frame, valid = case
    built = build(ref.text(tree), MaskOptions(**options))
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
        assert build(text).dense()[0, 0].astype(int).tolist() == expected
    sinks = build("causal & (window(3) | sink(1))", length=6).dense()[0, 0].astype(int)
    assert sinks[5].tolist() == [1, 0, 0, 1, 1, 1]
    assert build("~triu(1)", length=3).dense()[0, 0].astype(int).tolist() == [[0, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert build("document(sizes=[3,5])").json()["params"]["labels"] == [0, 0, 0, 1, 1, 1, 1, 1]


def test_behind_a_cache_every_kind_uses_absolute_positions():
    # the decode step of a window: query 9 sees keys 7, 8, 9
    decode = build("window(3)", offset=9, length=1)
    assert decode.intervals().row(0, 0) == [(7, 10)]
    # a sliding cache that dropped keys 0..5: the same window, fewer keys
    sliding = build("window(3)", offset=9, length=1, kv_start=6)
    assert sliding.shape == (1, 1, 1, 4) and sliding.intervals().row(0, 0) == [(7, 10)]
    assert sliding.dense()[0, 0, 0].tolist() == [False, True, True, True]
    # a static cache of 8 keys with 3 queries: top-left by default, bottom-right on request
    assert build("causal", length=3, kv_len=8).intervals().row(0, 2) == [(0, 3)]
    assert build("causal", length=3, kv_len=8, align="bottom-right").intervals().row(0, 0) == [(0, 6)]
    # document labels indexed by absolute position, behind an offset
    behind = build("document(0,0,1,1,1)", offset=3)
    assert behind.shape == (1, 1, 2, 5) and behind.dense()[0, 0].astype(int).tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


def test_llama4_local_attention_counts_chunks_from_the_first_real_token():
    # Hugging Face's chunked_overlay with left padding: (kv - pad) // C == (q - pad) // C, and causal
    left_padded = build("local(3)", ids="0,0,5,6,7,8,9,1")
    cells = left_padded.dense()[0, 0].astype(int)
    assert cells[4].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]  # tokens 2, 3, 4 are the first chunk
    assert cells[5].tolist() == [0, 0, 0, 0, 0, 1, 0, 0]  # token 5 starts the second
    plain = build("local(3)", length=8).dense()[0, 0].astype(int)
    assert plain[5].tolist() == [0, 0, 0, 1, 1, 1, 0, 0]


def test_tree_sees_the_prefix_its_ancestors_and_itself():
    drafted = build("tree(-1,0,0,1)", offset=3)
    assert drafted.shape == (1, 1, 4, 7)
    assert drafted.dense()[0, 0].astype(int).tolist() == [
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 1, 0],
        [1, 1, 1, 1, 1, 0, 1],
    ]
    with pytest.raises(MaskError, match=r"parents\[1\] is 1"):
        build("tree(-1,1)")
    with pytest.raises(MaskError, match="does not match the 4 draft tokens"):
        build("tree(-1,0,0,1)", length=3)


def test_labels_that_do_not_stay_few_fall_back_to_the_predicate():
    down = build("chunk(0,0,1,1,0,2)")
    assert not down.exact and "go down at position 4" in down.why_not_exact
    assert down.dense()[0, 0, 4].astype(int).tolist() == [1, 1, 0, 0, 1, 0]
    assert any("go down" in warning for warning in down.warnings)
    scattered = build("segment(" + ",".join(str(i % 2) for i in range(140)) + ")")
    assert not scattered.exact and "separate runs" in scattered.why_not_exact


def test_bare_kinds_take_their_parameters_from_flags():
    assert build("window", length=6, params={"--window": 2}).text == "window(2)"
    assert build("document & window", params={"--chunks": "0,0,1,1", "--window": 2}).text == "document(0,0,1,1) & window(2)"
    assert build("document", params={"--sizes": "2,2"}).text == "document(sizes=[2,2])"
    assert build("prefill", offset=4, length=2).text == "causal"
    assert build("triu", length=3, params={"--means": "keep"}).text == "triu(1, means=keep)"


@pytest.mark.parametrize(
    ("text", "options", "says"),
    [
        ("causal", {"params": {"--window": 3}}, "--window 3 does not apply to 'causal': it is for band, lookback, window"),
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
        build(text, MaskOptions(**options))
    assert says in str(error.value)


def test_labels_from_files(tmp_path):
    np.save(tmp_path / "labels.npy", np.array([0, 0, 1, 1, 1]))
    (tmp_path / "labels.json").write_text("[[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]")
    (tmp_path / "labels.txt").write_text("0 0 1 1 1\n")
    import torch

    torch.save(torch.tensor([0, 0, 1, 1, 1]), tmp_path / "labels.pt")
    expected = build("document(0,0,1,1,1)").dense()
    for name in ("labels.npy", "labels.txt", "labels.pt"):
        from_file = build(f'document("{tmp_path / name}")')
        assert np.array_equal(from_file.dense(), expected)
        assert from_file.text == f'document("{tmp_path / name}")'
    two = build(f'document("{tmp_path / "labels.json"}")')
    assert two.batch == 2 and two.dense()[1, 0, 1].astype(int).tolist() == [0, 1, 0, 0, 0]
    assert np.array_equal(build("document", params={"--chunks": str(tmp_path / "labels.npy")}).dense(), expected)


def test_a_million_token_mask_is_intervals_not_cells():
    sizes = ",".join(["4096"] * 256)
    long = build(f"document(sizes=[{sizes}]) & window(4096)")
    intervals = long.intervals()
    assert long.shape == (1, 1, 1 << 20, 1 << 20) and intervals.per_row == 1
    # closed form: each document of 4096 is causal inside, and a 4096 window never cuts it
    assert int(intervals.counts().sum()) == 256 * 4096 * 4097 // 2
    assert intervals.row(0, 5000) == [(4096, 5001)]


def test_sizes_come_from_the_data_when_len_is_not_given():
    assert build("causal").shape == (1, 1, 8, 8)
    assert build("causal", length=5, heads=3).shape == (1, 3, 5, 5)
    assert build("padding", lengths="4,2").shape == (2, 1, 4, 4)  # the longest length
    assert build("causal", offset=2, lengths="6,7").shape == (2, 1, 5, 7)
    assert build("padding", ids="5,0,0;6,7,0").shape == (2, 1, 3, 3)
    assert build("chunk(0,0,1)").shape == (1, 1, 3, 3)
    assert build("chunk(0,0,1,1)", offset=3).shape == (1, 1, 1, 4)
    words = "Your journey starts with one step"
    assert build("causal", tokens=words).shape == (1, 1, 6, 6)
    assert build("causal", offset=4, tokens=words).shape == (1, 1, 2, 6)
    assert build("causal", offset=4, tokens=words).tokens == tuple(words.split())


@pytest.mark.parametrize(
    ("text", "options", "says"),
    [
        ("chunk(0,0,1)", {"length": 2}, "have 3 entries but the mask covers positions 0-1"),
        ("causal", {"length": 3, "tokens": "a b"}, "--tokens 'a b' have 2 entries but the mask covers positions 0-2"),
        ("causal", {"offset": 2, "length": 1, "tokens": "a"}, "--tokens 'a' has 1 entry but the mask covers positions 0-2"),
        ("causal", {"tokens": "  "}, "--tokens '  ' has no words"),
        ("causal", {"offset": 6, "tokens": "a b c d e f"}, "--tokens 'a b c d e f' give 6 positions, none left for a query after --offset 6"),
        ("padding", {"lengths": "0,0"}, "the longest of --lengths give 0 positions"),
        ("padding", {"lengths": "2,-1"}, "--lengths values must be 0 or more, got -1 in '2,-1'"),
        ("padding", {"lengths": "2,x"}, "'x' at position 1 of '2,x' is not an integer"),
        ("padding", {"lengths": "2;3"}, "one length per batch row"),
        ("padding", {"ids": "1,2,0", "length": 4}, "--ids rows have 3 tokens but the sequence has 4 positions"),
        ("padding", {"ids": "1,2;3"}, "the batch rows have 2, 1 tokens, in that order"),
        ("padding", {"ids": "1,2", "lengths": "2"}, "either --lengths or --ids, not both"),
        ("causal", {"heads": 0}, "--heads must be at least 1"),
        ("prefix(9)", {"length": 4}, "the prefix of 9 is longer than the sequence (4 tokens)"),
        ("chunk", {"params": {"--chunks": "0,a,1"}}, "'a' at position 1 of '0,a,1' is not an integer"),
        ("chunk", {"params": {"--chunks": ""}}, "no values"),
        ("chunk", {}, "chunk needs --chunks LABELS"),
        ("causal", {"params": {"--diagonal": 1}}, "--diagonal 1 does not apply to 'causal': it is for tril, triu"),
        ("window", {"params": {"--window": 2, "--prefix": 1}}, "--prefix 1 does not apply to 'window'"),
        ("document", {"params": {"--chunks": "0,1", "--sizes": "1,1"}}, "give --chunks or --sizes, not both"),
        ("Causal", {}, "unknown mask kind 'Causal': did you mean causal?"),
    ],
)
def test_every_refusal_is_one_line_that_says_what(text, options, says):
    with pytest.raises(MaskError) as error:
        build(text, MaskOptions(**options))
    assert says in str(error.value)
    assert "\n" not in str(error.value)
    assert isinstance(error.value, ValueError)  # library callers may catch it as a ValueError


def test_building_a_mask_imports_numpy_but_not_torch():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from maskcli.mask import build\n"
        "m = build('document(0,0,1,1) & window(2)', lengths='4,3', tokens='a b c d')\n"
        "m.dense(); m.intervals(); m.json()\n"
        "print(sorted(name for name in ('torch', 'matplotlib', 'rich', 'typer') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- against PyTorch's own matrices and mask_mods ------------------------------------------------

import torch  # noqa: E402
from torch.nn.attention.flex_attention import and_masks as flex_and_masks  # noqa: E402
from torch.nn.attention.flex_attention import create_mask  # noqa: E402
from torch.nn.attention.flex_attention import or_masks as flex_or_masks  # noqa: E402

FAST = settings(max_examples=40, deadline=None)


@FAST
@given(length=st.integers(1, 10), diagonal=st.integers(-5, 5), means=st.sampled_from([None, "keep", "block"]))
def test_tril_and_triu_are_the_raw_torch_matrices(length, diagonal, means):
    extra = "" if means is None else f", means={means}"
    tril = build(f"tril({diagonal}{extra})", length=length).materialize()[0, 0]
    triu = build(f"triu({diagonal}{extra})", length=length).materialize()[0, 0]
    raw_l = torch.tril(torch.ones(length, length), diagonal).bool()
    raw_u = torch.triu(torch.ones(length, length), diagonal).bool()
    assert torch.equal(tril, raw_l if means in (None, "keep") else ~raw_l)  # tril reads its 1-cells as keep
    assert torch.equal(triu, raw_u if means == "keep" else ~raw_u)  # triu reads them as block


@pytest.mark.parametrize("length", [1, 2, 5, 9])
def test_tril_triu_and_causal_defaults_are_the_tutorial_mask(length):
    from maskcli.conventions import to_convention

    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    for text in ("causal", "tril", "triu", "tril(0)", "~triu(1, means=keep)"):
        assert torch.equal(build(text, length=length).materialize()[0, 0], causal), text
    # the llama idiom: triu(full(-inf), 1) added to the scores is the causal mask, additive
    llama = torch.triu(torch.full((length, length), float("-inf")), 1)
    assert torch.equal(to_convention(build("triu", length=length).materialize(), "additive")[0, 0], llama)
    assert torch.equal(
        to_convention(build("causal", length=length).materialize(), "additive")[0, 0],
        torch.nn.Transformer.generate_square_subsequent_mask(length),
    )


@FAST
@given(offset=st.integers(0, 10), length=st.integers(1, 10))
def test_prefill_is_torch_tril_moved_right_by_the_cache(offset, length):
    keep = build("prefill", offset=offset, length=length).materialize()[0, 0]
    assert torch.equal(keep, torch.ones(length, offset + length).tril(offset).bool())


def test_causal_with_padding_is_the_merged_decoder_mask():
    keep = build("causal", length=4, lengths="4,2").materialize()
    lengths = torch.tensor([4, 2])
    key_valid = torch.arange(4)[None, :] < lengths[:, None]
    recipe = torch.tril(torch.ones(4, 4, dtype=torch.bool))[None, None] & key_valid[:, None, None, :]
    assert torch.equal(keep, recipe)


@FAST
@given(data=st.data())
def test_materialize_a_window_of_rows_is_that_slice_of_the_whole(data):
    built = build("document(0,0,1,1,1,2,2) & window(3) | sink(1)", offset=None)
    whole = built.materialize()
    q_lo = data.draw(st.integers(0, 6))
    q_hi = data.draw(st.integers(q_lo + 1, 7))
    assert torch.equal(built.materialize(q_range=range(q_lo, q_hi)), whole[:, :, q_lo:q_hi])
    assert np.array_equal(built.cells(0, 0, q_lo, q_hi), whole[0, 0, q_lo:q_hi].numpy())


def test_and_or_not_of_predicates_are_flex_attentions():
    a, b = build("window(3)", length=7), build("prefix(2)", length=7)
    both, either, neither = (build(text, length=7) for text in ("window(3) & prefix(2)", "window(3) | prefix(2)", "~(window(3) | prefix(2))"))
    flex_both = create_mask(flex_and_masks(a.mask_mod, b.mask_mod), 1, 1, 7, 7, device="cpu")
    flex_either = create_mask(flex_or_masks(a.mask_mod, b.mask_mod), 1, 1, 7, 7, device="cpu")
    assert torch.equal(create_mask(both.mask_mod, 1, 1, 7, 7, device="cpu"), flex_both)
    assert torch.equal(create_mask(either.mask_mod, 1, 1, 7, 7, device="cpu"), flex_either)
    assert torch.equal(neither.materialize(), ~flex_either)


def test_the_exported_mask_mod_adds_the_offsets_for_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    built = build("document(sizes=[100,60,40]) & window(32)", offset=150, length=50)
    block = create_block_mask(built.mask_mod, None, None, 50, 200, device="cpu", BLOCK_SIZE=16)
    assert torch.equal(block.to_dense().bool()[0, 0, :50, :200].any(), torch.tensor(True))
    dense = create_mask(built.mask_mod, 1, 1, 50, 200, device="cpu")
    assert np.array_equal(dense[0, 0].numpy(), built.dense()[0, 0])


def test_a_mask_is_immutable_and_its_dense_form_is_guarded(monkeypatch):
    from maskcli import memory

    built, smaller = build("causal", length=32), build("causal", length=31)
    with pytest.raises(AttributeError):
        built.batch = 3
    assert built.exact and smaller.exact  # the intervals, a few integers per row, are made first
    monkeypatch.setattr(memory, "available_memory", lambda device=None: 1000)
    with pytest.raises(MaskError, match=r"1,024 bytes") as error:
        built.dense()  # 32 x 32 bool cells
    assert "1 x 1 x 32 x 32" in str(error.value)
    assert smaller.dense().shape == (1, 1, 31, 31)  # 961 bytes fits
    monkeypatch.setattr(memory, "available_memory", lambda device=None: None)  # the platform cannot say: go ahead
    assert build("causal", length=32).dense().shape == (1, 1, 32, 32)


def test_intervals_of_an_impossible_length_are_refused_up_front():
    with pytest.raises(MaskError, match="for its key intervals"):
        build("causal", length=10**12).exact


def test_a_billion_token_document_is_refused_before_its_labels_are_made(monkeypatch):
    from maskcli import memory

    monkeypatch.setattr(memory, "available_memory", lambda device=None: 32 << 30)  # room for the labels, not the rows
    built = build("document(sizes=[1000000000])")
    assert built.shape == (1, 1, 10**9, 10**9)
    with pytest.raises(MaskError) as error:
        built.exact
    assert str(error.value) == (
        "a mask of 1 x 1000000000 would need 89.4 GiB (96,000,000,000 bytes) for its key intervals, but only 32.0 GiB "
        "is free: use fewer positions in its labels: maskcli keeps a few integers per query row"
    )
    labels = built.tree.values["labels"]
    assert "array" not in labels.__dict__  # nothing of 10^9 positions was made


# --- Hugging Face style masks, written here the way masking_utils writes them ----------------------


def hf_and(*functions):
    def inner(b, h, q, kv):
        result = torch.ones((), dtype=torch.bool)
        for function in functions:
            result = result & function(b, h, q, kv)
        return result

    return inner


def hf_or(*functions):
    def inner(b, h, q, kv):
        result = torch.zeros((), dtype=torch.bool)
        for function in functions:
            result = result | function(b, h, q, kv)
        return result

    return inner


def hf_causal(b, h, q, kv):
    return kv <= q


def hf_sliding_window_overlay(window):
    return lambda b, h, q, kv: kv > q - window


def hf_chunked_overlay(chunk_size, left_padding):
    return lambda b, h, q, kv: (kv - left_padding[b]) // chunk_size == (q - left_padding[b]) // chunk_size


def hf_padding(attention_mask):
    return lambda b, h, q, kv: attention_mask[b, kv].bool()


def hf_blockwise_overlay(block_ids):
    """Tokens of the same block (id >= 0) see each other both ways: Gemma 3's image tokens."""
    return lambda b, h, q, kv: (block_ids[b, q] == block_ids[b, kv]) & (block_ids[b, q] >= 0)


def hf_mask(function, batch, cache_position, kv_length, kv_offset):
    """What sdpa_mask evaluates: absolute query positions against kv_offset + arange(kv_length)."""
    b = torch.arange(batch)[:, None, None, None]
    h = torch.arange(1)[None, :, None, None]
    q = cache_position[None, None, :, None]
    kv = (torch.arange(kv_length) + kv_offset)[None, None, None, :]
    return torch.broadcast_to(function(b, h, q, kv), (batch, 1, len(cache_position), kv_length))


def test_llama4_chunked_attention_with_left_padding_is_reproduced():
    attention_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    left_padding = (attention_mask.cumsum(dim=-1) == torch.zeros_like(attention_mask)).sum(dim=-1)  # as HF counts it
    function = hf_and(hf_causal, hf_chunked_overlay(4, left_padding), hf_padding(attention_mask))
    for cache_position, offset in ((torch.arange(11), None), (torch.arange(8, 11), 8)):
        expected = hf_mask(function, 2, cache_position, 11, 0)
        ids = ";".join(",".join(map(str, row)) for row in attention_mask.tolist())
        got = build("local(4)", ids=ids, offset=offset, length=len(cache_position)).materialize()
        assert torch.equal(got, expected)


def test_gemma3_image_blocks_over_causal_text_are_reproduced():
    block_ids = torch.tensor([[-1, -1, 0, 0, 0, -1, 1, 1, -1]])
    expected = hf_mask(hf_or(hf_causal, hf_blockwise_overlay(block_ids)), 1, torch.arange(9), 9, 0)
    assert torch.equal(build("causal | blocks(-1,-1,0,0,0,-1,1,1,-1)").materialize(), expected)


def test_gemma3_sliding_layers_with_image_tokens_are_reproduced():
    """and_masks(or_masks(causal, blockwise_overlay), sliding_window_overlay): the window is not causal there."""
    from torch.nn.attention.flex_attention import create_mask

    block_ids = torch.tensor([[-1, -1, 0, 0, 0, 0, -1, 1, 1, -1], [0, 0, 0, -1, -1, -1, -1, -1, 1, 1]])
    ids = ";".join(",".join(map(str, row)) for row in block_ids.tolist())
    for window in (1, 2, 3, 12):
        function = hf_and(hf_or(hf_causal, hf_blockwise_overlay(block_ids)), hf_sliding_window_overlay(window))
        for cache_position, offset in ((torch.arange(10), None), (torch.arange(4, 10), 4)):
            expected = hf_mask(function, 2, cache_position, 10, 0)
            built = build(f"(causal | blocks({ids})) & lookback({window})", offset=offset, length=len(cache_position))
            assert built.exact
            assert torch.equal(built.materialize(), expected)  # the predicate
            assert np.array_equal(built.dense(), expected.numpy())  # the intervals
    # & window(W) instead drops the image's later keys: query 3 no longer sees keys 4, 5 of its image
    expected = hf_mask(hf_and(hf_or(hf_causal, hf_blockwise_overlay(block_ids)), hf_sliding_window_overlay(2)), 2, torch.arange(10), 10, 0)
    causal_window = build(f"(causal | blocks({ids})) & window(2)").materialize()
    assert bool(expected[0, 0, 3, 4]) and not bool(causal_window[0, 0, 3, 4])


@pytest.mark.parametrize("window", [1, 3, 5])
def test_lookback_is_the_sliding_window_overlay_by_a_double_loop_and_flex_create_mask(window):
    from torch.nn.attention.flex_attention import create_mask

    for offset, kv_start, kv_len in ((0, 0, None), (4, 2, None), (0, 0, 9)):
        built = build(f"lookback({window})", length=6, offset=offset or None, kv_start=kv_start or None, kv_len=kv_len)
        f = built.frame
        loop = [[kv > q - window for kv in range(f.k_start, f.k_end)] for q in range(f.q_start, f.q_end)]
        assert built.dense()[0, 0].tolist() == loop
        assert built.intervals().counts().sum() == sum(map(sum, loop))

        def overlay(b, h, q_idx, kv_idx):  # Hugging Face's sliding_window_overlay on FlexAttention's local indices
            return kv_idx + f.k_start > q_idx + f.q_start - window

        flex = create_mask(overlay, 1, 1, f.q_len, f.k_len, device="cpu")
        assert torch.equal(flex, built.materialize())
        assert torch.equal(create_mask(built.mask_mod, 1, 1, f.q_len, f.k_len, device="cpu"), flex)


def hf_packed(function, position_ids):
    """create_causal_mask's packed path: the mask function at the position_ids (remap_positions_for_packed_sequence),
    and-ed with the same-sequence mask of find_packed_sequence_indices."""
    first = position_ids[:, :1] - 1
    sequence = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)

    def inner(b, h, q, kv):
        same = sequence[b, q] == sequence[b, kv]
        return function(b, h, position_ids[b, q], position_ids[b, kv]) & same

    return inner, sequence


def test_llama4_packed_chunks_restart_at_each_document():
    """Hugging Face's create_chunked_causal_mask for packed sequences (position_ids that restart, no attention_mask)."""
    from torch.nn.attention.flex_attention import create_mask

    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    for chunk_size in (1, 2, 3, 4, 16):
        function, sequence = hf_packed(hf_and(hf_causal, hf_chunked_overlay(chunk_size, torch.zeros(2, dtype=torch.long))), position_ids)
        expected = hf_mask(function, 2, torch.arange(14), 14, 0)
        labels = ";".join(",".join(map(str, row)) for row in sequence.tolist())
        for text in (f"document({labels}) & local({chunk_size})", f"local({chunk_size}, documents=[{labels}])"):
            built = build(text)
            assert built.exact
            assert torch.equal(built.materialize(), expected), text
            assert np.array_equal(built.dense(), expected.numpy()), text
            flex = create_mask(built.mask_mod, 2, 1, 14, 14, device="cpu")
            assert torch.equal(flex, expected), text
        # before: chunks counted from position 0 of the row, so query 6 (position 1 of document 1) saw nothing of it
        unpacked = build(f"document({labels}) & local({chunk_size}, documents=[{','.join(['0'] * 14)}])").materialize()
        assert torch.equal(unpacked, hf_mask(hf_and(hf_causal, hf_chunked_overlay(chunk_size, torch.zeros(2, dtype=torch.long)),
                                                    lambda b, h, q, kv: sequence[b, q] == sequence[b, kv]), 2, torch.arange(14), 14, 0))
        if chunk_size in (2, 3, 4):
            assert not torch.equal(unpacked, expected)


def test_packed_chunks_behind_a_cache_and_with_left_padding_follow_the_definition():
    labels = [[0, 0, 0, 0, 1, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]]
    text = ";".join(",".join(map(str, row)) for row in labels)
    ids = "0,0,5,5,5,5,5,5,5,5;5,5,5,5,5,5,5,5,5,5"
    for options in ({}, {"offset": 6, "length": 4}, {"ids": ids}, {"ids": ids, "offset": 3, "length": 7}):
        built = build(f"document({text}) & local(3)", MaskOptions(**options))
        f = built.frame
        valid = None if "ids" not in options else [[t != "0" for t in row.split(",")] for row in ids.split(";")]
        left = [ref.left_padding(row) for row in valid] if valid else [0, 0]
        tree = ("and", [("kind", "document", {"labels": labels}), ("kind", "local", {"chunk_size": 3})])
        expected = ref.dense(tree, q0=f.q_start, lq=f.q_len, k0=f.k_start, lk=f.k_len, batch=2, valid=valid, ids_valid_left_pad=left)
        assert built.dense()[:, 0].tolist() == expected
        assert built.materialize().numpy()[:, 0].tolist() == expected


def test_local_takes_the_expressions_one_set_of_document_labels():
    built = build("document(0,0,0,1,1,1) & local(2)")
    assert built.json()["expression"] == "document(0,0,0,1,1,1) & local(2)"  # the name stays as written
    assert built.json()["kinds"][1]["params"] == {"chunk_size": 2, "documents": [0, 0, 0, 1, 1, 1]}
    same = build("document(0,0,0,1,1,1) & segment(0,0,0,1,1,1) & local(2)")
    assert same.dense().tolist() == built.dense().tolist()
    with pytest.raises(MaskError, match=r"different document labels .*documents=\[0,0,1,1\]"):
        build("document(0,0,0,1,1,1) & segment(0,0,1,1,1,1) & local(2)")
    # written out, it prints and parses back; labels from a file too
    explicit = build("local(2, documents=[0,0,0,1,1,1])")
    assert explicit.json()["expression"] == "local(2, documents=[0,0,0,1,1,1])"
    assert explicit.dense().tolist() == built.dense().tolist()
    assert build(explicit.json()["expression"]).dense().tolist() == built.dense().tolist()
    flags = build("local", params={"--chunk-size": 2, "--documents": "0,0,0,1,1,1"})  # a bare local, from its flags
    assert flags.dense().tolist() == built.dense().tolist()


def test_packed_chunks_at_a_million_tokens_are_intervals():
    from bounded import MIB, builds_under

    sizes, chunk = [300_001, 8_191, 691_808], 8192
    with builds_under(512 * MIB):  # a few arrays of a million positions, not 10^12 cells
        built = build(f"document(sizes=[{','.join(map(str, sizes))}]) & local({chunk})")
        counts = built.intervals().counts()
    assert built.exact
    # each query sees its chunk so far: (position in its document mod C) + 1 keys
    within = np.concatenate([np.arange(size) for size in sizes])
    assert np.array_equal(counts[0], within % chunk + 1)


def test_gemma3_sliding_and_llama4_packed_masks_are_the_installed_transformers():
    """Where transformers is installed (it is not a dependency): its own mask functions, not a copy of them."""
    mu = pytest.importorskip("transformers.masking_utils")
    config_class = pytest.importorskip("transformers").Llama4TextConfig
    block_ids = torch.tensor([[-1, -1, 0, 0, 0, 0, -1, 1, 1, -1], [0, 0, 0, -1, -1, -1, -1, -1, 1, 1]])
    ids = ";".join(",".join(map(str, row)) for row in block_ids.tolist())
    for window in (1, 2, 5):
        function = mu.and_masks(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(block_ids)), mu.sliding_window_overlay(window))
        for offset, length in ((0, 10), (6, 4)):
            expected = mu.sdpa_mask(batch_size=2, q_length=length, kv_length=10, q_offset=offset, kv_offset=0, mask_function=function,
                                    allow_is_causal_skip=False, use_vmap=True)
            got = build(f"(causal | blocks({ids})) & lookback({window})", offset=offset or None, length=length)
            assert torch.equal(got.materialize().expand_as(expected), expected)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    labels = ";".join(",".join(map(str, row)) for row in mu.find_packed_sequence_indices(position_ids).tolist())
    for chunk_size in (1, 2, 3, 8):
        config = config_class(attention_chunk_size=chunk_size, hidden_size=8, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                              num_hidden_layers=1, vocab_size=10, intermediate_size=8, intermediate_size_mlp=8)
        config._attn_implementation = "sdpa"
        expected = mu.create_chunked_causal_mask(config=config, inputs_embeds=torch.zeros(2, 14, 8), attention_mask=None, cache=None,
                                                 position_ids=position_ids)
        assert torch.equal(build(f"document({labels}) & local({chunk_size})").materialize(), expected)


def test_a_sliding_window_behind_a_sliding_cache_is_reproduced():
    """Mistral decoding at position 20 with a 4096-style window of 5, its cache holding only the last 5 keys."""
    window, position = 5, 20
    function = hf_and(hf_causal, hf_sliding_window_overlay(window))
    cache_position = torch.tensor([position])
    kv_offset = position - window + 1  # the cache dropped every key older than the window
    expected = hf_mask(function, 1, cache_position, window, kv_offset)
    got = build(f"window({window})", offset=position, length=1, kv_start=kv_offset)
    assert torch.equal(got.materialize(), expected) and bool(expected.all())
    # prefill of 3 tokens after 10 cached ones, a static cache of 16 slots: the empty slots stay hidden
    function = hf_and(hf_causal, hf_sliding_window_overlay(4))
    expected = hf_mask(function, 1, torch.arange(10, 13), 16, 0)
    assert torch.equal(build("window(4)", offset=10, length=3, kv_len=16).materialize(), expected)


def test_default_file_names_tell_negative_numbers_apart():
    names = {text: build(text, MaskOptions()).slug for text in ("tril(1)", "tril(-1)", "causal & window(3)", "~triu(1)")}
    assert names == {"tril(1)": "tril_1", "tril(-1)": "tril_minus_1", "causal & window(3)": "causal_and_window_3", "~triu(1)": "not_triu_1"}


# --- regions: a view of part of the whole mask -----------------------------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases(), cut=st.tuples(st.integers(0, 8), st.integers(0, 8), st.integers(0, 8), st.integers(0, 8)))
def test_a_region_holds_the_cells_of_the_whole_mask_there(case, cut):
    from maskcli.summary import summarise

    tree, options, frame, valid = case
    whole = build(ref.text(tree), MaskOptions(**options))
    cells = expected_cells(tree, options, frame, valid, whole.batch)  # the double loop over absolute positions
    q0, lq, k0, lk = frame
    q_lo, q_hi = sorted((q0 + cut[0] % lq, q0 + cut[1] % lq))
    k_lo, k_hi = sorted((k0 + cut[2] % lk, k0 + cut[3] % lk))
    q_hi, k_hi = q_hi + 1, k_hi + 1
    view = whole.crop((q_lo, q_hi), (k_lo, k_hi))
    part = cells[:, q_lo - q0 : q_hi - q0, k_lo - k0 : k_hi - k0]
    assert view.shape == (whole.batch, whole.heads, q_hi - q_lo, k_hi - k_lo)
    assert np.array_equal(np.broadcast_to(view.dense()[:, 0], part.shape), part)
    assert np.array_equal(view.materialize().numpy()[:, 0], part)  # the predicate, at the region's positions
    assert summarise(view, (2, 3)).visible == int(part.sum()) * whole.heads
    if whole.exact:
        counts = np.broadcast_to(view.intervals().counts(), (whole.batch, q_hi - q_lo))
        assert view.exact and np.array_equal(counts, part.sum(-1))


def test_a_region_of_a_million_token_mask_is_exact_and_costs_its_own_rows():
    from bounded import MIB, builds_under

    with builds_under(512 * MIB):  # the region's 10^5 cells and a few arrays of a million positions
        whole = build("document(sizes=[300000,748576]) & window(4096)")
        view = whole.crop((299_990, 300_010), (295_000, 300_005))
        cells = view.dense()[0, 0]
    assert cells.shape == (20, 5005)
    q = np.arange(299_990, 300_010)[:, None]
    kv = np.arange(295_000, 300_005)[None, :]
    same = (q < 300_000) == (kv < 300_000)
    assert np.array_equal(cells, same & (kv <= q) & (q - kv < 4096))


@pytest.mark.parametrize("rows, keys, says", [
    ((5, 3), (None, None), "--rows 5:3 is outside the queries 0-7 of this mask (or empty): give A:B with 0 <= A < B <= 8"),
    ((None, 9), (None, None), "--rows :9 is outside the queries 0-7"),
    ((None, None), (-1, None), "--keys -1: is outside the keys 0-7"),
])
def test_a_region_outside_the_mask_names_the_valid_range(rows, keys, says):
    with pytest.raises(MaskError, match=re.escape(says)):
        build("causal", length=8).crop(rows, keys)


def test_from_terms_makes_the_mask_of_kinds_at_a_frame_with_no_text_parsed():
    """Terms bound by hand (as serve's requests are) at queries 6..8 of keys 0..8: prefix(3) & window(2) is, by a
    double loop, (kv < 3 or kv <= q) and q - 2 < kv <= q; the name is made from the terms."""
    from maskcli import expression as ex
    from maskcli.kinds import get
    from maskcli.mask import from_terms
    from maskcli.positions import Frame
    from maskcli.terms import Term

    tree = ex.And((Term(get("prefix"), (("prefix", 3),)), Term(get("window"), (("window", 2),))))
    mask = from_terms(tree, Frame(6, 3, 0, 9))
    want = np.array([[(k < 3 or k <= q) and q - 2 < k <= q for k in range(9)] for q in range(6, 9)])
    assert mask.text == "prefix(3) & window(2)"
    assert np.array_equal(mask.dense()[0, 0], want)
    with pytest.raises(MaskError, match="prefix of 12 is longer than the sequence"):
        from_terms(Term(get("prefix"), (("prefix", 12),)), Frame(6, 3, 0, 9))  # the kind's own check still runs


@pytest.mark.parametrize("expression, flags", [("causal", {"length": 5}), ("document(0,0,1,1,1,1)", {}),
                                               ("window(2)", {"length": 3, "offset": 4}), ("causal", {"lengths": "4,6"})])
def test_placing_is_the_frame_placed_builds(expression, flags):
    from maskcli.mask import placed, placing

    tree, options = build(expression).expression, MaskOptions(**flags)
    frame, _ = placing(tree, options)
    f = placed(tree, options).frame
    assert (frame.q_start, frame.q_len, frame.k_start, frame.k_len, frame.lengths) == (f.q_start, f.q_len, f.k_start, f.k_len, f.lengths)
