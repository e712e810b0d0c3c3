"""Parsing and validation into MaskSpec: properties of the parsers, size resolution, every refusal."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from maskcli.errors import MaskError
from maskcli.spec import KINDS, MAX_LEN, MaskSpec, make_spec, parse_ids, parse_ints, parse_tokens

FAST = settings(max_examples=50, deadline=None)
ints = st.integers(min_value=-(10**15), max_value=10**15)
blank = st.sampled_from(["", " ", "  ", "\t"])
INTEGER = re.compile(r"\s*[+-]?[0-9]+\s*")


# --- parse_ints ----------------------------------------------------------------------


@FAST
@given(values=st.lists(ints, min_size=1, max_size=12))
def test_parse_ints_round_trips_comma_separated(values):
    assert parse_ints(",".join(map(str, values)), "labels") == tuple(values)


@FAST
@given(data=st.data(), values=st.lists(ints, min_size=1, max_size=12))
def test_parse_ints_round_trips_with_spaces_anywhere(data, values):
    parts = [data.draw(blank) + str(value) + data.draw(blank) for value in values]
    assert parse_ints(",".join(parts), "labels") == tuple(values)


bad_items = st.text(alphabet="abxyz.e/-+ 1", min_size=1, max_size=5).filter(
    lambda item: item.strip() and not INTEGER.fullmatch(item)
)


@FAST
@given(data=st.data(), values=st.lists(ints, max_size=6), bad=bad_items)
def test_parse_ints_rejects_a_non_integer_quoting_it_and_its_position(data, values, bad):
    position = data.draw(st.integers(0, len(values)))
    items = [str(v) for v in values]
    items.insert(position, bad)
    text = ",".join(items)
    with pytest.raises(MaskError) as error:
        parse_ints(text, "chunk labels")
    message = str(error.value)
    assert message.startswith("chunk labels must be integers")
    assert f"got {bad.strip()!r} at position {position}" in message
    assert "\n" not in message


@pytest.mark.parametrize("text, item, position", [("1,,2", "", 1), ("1,2,", "", 2), ("0.5", "0.5", 0),
                                                  ("0,0,1,one", "one", 3), ("1;2", "1;2", 0)])
def test_parse_ints_names_the_bad_item(text, item, position):
    with pytest.raises(MaskError, match=re.escape(f"got {item!r} at position {position} of {text!r}")):
        parse_ints(text, "chunk labels")


@pytest.mark.parametrize("text", ["", " ", ",", " , ,  ", "\t"])
def test_parse_ints_refuses_empty_input(text):
    with pytest.raises(MaskError, match="chunk labels are empty"):
        parse_ints(text, "chunk labels")


# --- parse_ids, parse_tokens -----------------------------------------------------------


@FAST
@given(data=st.data(), width=st.integers(1, 6))
def test_parse_ids_round_trips_rows(data, width):
    rows = data.draw(st.lists(st.lists(st.integers(-5, 50000), min_size=width, max_size=width), min_size=1, max_size=4))
    text = ";".join(",".join(map(str, row)) for row in rows)
    assert parse_ids(text) == tuple(tuple(row) for row in rows)
    assert parse_ids(text.replace(",", ", ").replace(";", " ; ")) == tuple(tuple(row) for row in rows)


@FAST
@given(rows=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=5), min_size=2, max_size=4))
def test_parse_ids_refuses_rows_of_different_lengths(rows):
    assume(len({len(row) for row in rows}) > 1)
    text = ";".join(",".join(map(str, row)) for row in rows)
    with pytest.raises(MaskError) as error:
        parse_ids(text)
    assert repr(text) in str(error.value) and str(sorted({len(row) for row in rows})) in str(error.value)


def test_parse_ids_bad_item_and_empty_row():
    with pytest.raises(MaskError, match=re.escape("got 'x' at position 1")):
        parse_ids("1,x;3,4")
    with pytest.raises(MaskError, match="empty"):
        parse_ids("1,2;")


@FAST
@given(words=st.lists(st.text(alphabet="abcXYZ'é", min_size=1, max_size=6), min_size=1, max_size=8), gap=st.sampled_from([" ", "  ", "\t", " \n "]))
def test_parse_tokens_splits_on_white_space(words, gap):
    assert parse_tokens(gap + gap.join(words) + gap) == tuple(words)


@pytest.mark.parametrize("text", ["", "   ", "\t\n"])
def test_parse_tokens_refuses_no_words(text):
    with pytest.raises(MaskError, match="has no words"):
        parse_tokens(text)


# --- make_spec: sizes ----------------------------------------------------------------


def test_default_length_is_8():
    assert make_spec("causal").shape == (1, 1, 8, 8)


@FAST
@given(length=st.integers(1, 10**6), heads=st.integers(1, 16))
def test_length_and_heads_give_the_shape(length, heads):
    spec = make_spec("causal", length=length, heads=heads)
    assert spec.shape == (1, heads, length, length) and spec.offset == 0


@FAST
@given(offset=st.integers(0, 1000), length=st.integers(1, 1000))
def test_prefill_sizes(offset, length):
    spec = make_spec("prefill", offset=offset, length=length)
    assert (spec.q_len, spec.k_len, spec.offset) == (length, offset + length, offset)


@FAST
@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=5))
def test_lengths_without_len_take_the_longest(lengths):
    assume(max(lengths) > 0)
    spec = make_spec("padding", lengths=",".join(map(str, lengths)))
    longest = max(lengths)
    assert spec.shape == (len(lengths), 1, longest, longest)
    assert spec.lengths == tuple(lengths)
    assert spec.key_valid == tuple(tuple(k < n for k in range(longest)) for n in lengths)


@FAST
@given(offset=st.integers(0, 5), lengths=st.lists(st.integers(6, 12), min_size=1, max_size=3))
def test_prefill_lengths_without_len_leave_the_rest_as_queries(offset, lengths):
    spec = make_spec("prefill", offset=offset, lengths=",".join(map(str, lengths)))
    assert (spec.q_len, spec.k_len, spec.batch) == (max(lengths) - offset, max(lengths), len(lengths))


@FAST
@given(rows=st.lists(st.lists(st.integers(0, 3), min_size=4, max_size=4), min_size=1, max_size=3), pad_id=st.integers(0, 3))
def test_ids_give_batch_length_and_valid_keys(rows, pad_id):
    spec = make_spec("padding", ids=";".join(",".join(map(str, r)) for r in rows), pad_id=pad_id)
    assert spec.shape == (len(rows), 1, 4, 4)
    assert spec.key_valid == tuple(tuple(token != pad_id for token in row) for row in rows)
    assert spec.pad_id == pad_id and spec.ids == tuple(map(tuple, rows))


@FAST
@given(labels=st.lists(st.integers(-3, 5), min_size=1, max_size=20), kind=st.sampled_from(["chunk", "document"]))
def test_labels_give_the_length_and_warn_when_they_go_down(labels, kind):
    spec = make_spec(kind, chunks=",".join(map(str, labels)))
    assert spec.shape == (1, 1, len(labels), len(labels)) and spec.labels == tuple(labels)
    downs = [i for i in range(1, len(labels)) if labels[i] < labels[i - 1]]
    if kind == "chunk" and downs:
        (warning,) = spec.warnings
        assert f"position {downs[0]} ({labels[downs[0] - 1]} then {labels[downs[0]]})" in warning
    else:
        assert spec.warnings == ()
    # --len may repeat the count
    assert make_spec(kind, chunks=",".join(map(str, labels)), length=len(labels)) == spec


def test_tril_triu_defaults():
    tril, triu = make_spec("tril"), make_spec("triu")
    assert (tril.diagonal, tril.means, triu.diagonal, triu.means) == (0, "keep", 1, "block")
    assert make_spec("triu", diagonal=-2, means="keep").diagonal == -2


def test_tokens_are_one_per_key_position():
    spec = make_spec("prefill", offset=2, length=2, tokens="Your journey starts here")
    assert spec.tokens == ("Your", "journey", "starts", "here")


def test_spec_is_immutable_and_named():
    spec = make_spec("window", length=8, window=3)
    assert isinstance(spec, MaskSpec) and spec.name == "sliding_window_3"
    with pytest.raises(AttributeError):
        spec.q_len = 9
    assert make_spec("causal", lengths="3,2").name == "causal_padded"
    assert make_spec("triu", means="keep").name == "triu_1_as_keep"


@pytest.mark.parametrize("kwargs, params", [
    ({"kind": "causal", "length": 4}, {"len": 4}),
    ({"kind": "prefill", "offset": 3, "length": 2}, {"len": 2, "offset": 3}),
    ({"kind": "tril", "length": 4}, {"len": 4, "diagonal": 0, "means": "keep"}),
    ({"kind": "triu", "length": 4, "diagonal": 2, "means": "keep"}, {"len": 4, "diagonal": 2, "means": "keep"}),
    ({"kind": "window", "length": 5, "window": 2, "heads": 3}, {"len": 5, "window": 2, "heads": 3}),
    ({"kind": "prefix", "length": 5, "prefix": 2}, {"len": 5, "prefix": 2}),
    ({"kind": "chunk", "chunks": "0,0,1"}, {"chunks": [0, 0, 1]}),
    ({"kind": "document", "chunks": "0,1,1", "lengths": "2"}, {"chunks": [0, 1, 1], "lengths": [2]}),
    ({"kind": "padding", "ids": "5,0;6,7", "pad_id": 0}, {"len": 2, "ids": [[5, 0], [6, 7]], "pad_id": 0}),
])
def test_params(kwargs, params):
    kwargs = dict(kwargs)
    assert make_spec(kwargs.pop("kind"), **kwargs).params == params


# --- make_spec: every refusal ----------------------------------------------------------


REFUSALS = [
    # labels that are not integers, empty labels
    ({"kind": "chunk", "chunks": "0,a,1"}, "must be integers, got 'a' at position 1"),
    ({"kind": "document", "chunks": "0,1.5"}, "got '1.5' at position 1"),
    ({"kind": "chunk", "chunks": ""}, "chunk labels are empty"),
    ({"kind": "chunk", "chunks": " , "}, "chunk labels are empty"),
    ({"kind": "chunk"}, "chunk needs --chunks"),
    # --len zero or negative, or too large
    ({"kind": "causal", "length": 0}, "--len must be at least 1 (the number of query positions), got 0"),
    ({"kind": "causal", "length": -4}, "got -4"),
    ({"kind": "causal", "length": MAX_LEN + 1}, f"--len {MAX_LEN + 1} is too large"),
    ({"kind": "chunk", "chunks": "0,1", "length": 3}, "--len 3 does not match the 2 chunk labels"),
    # a length larger than --len
    ({"kind": "padding", "lengths": "4,9", "length": 5}, "length 9 in --lengths '4,9' is larger than the sequence length 5"),
    ({"kind": "chunk", "chunks": "0,1", "lengths": "3"}, "length 3 in --lengths '3' is larger than the sequence length 2"),
    ({"kind": "padding", "lengths": "2,-1"}, "--lengths values must be 0 or more, got -1 in '2,-1'"),
    ({"kind": "padding", "lengths": "2,x"}, "got 'x' at position 1"),
    ({"kind": "padding", "lengths": "0,0"}, "the longest sequence (0) leaves no new query"),
    ({"kind": "padding", "ids": "1,2,0", "length": 4}, "--ids rows have 3 tokens but the sequence has 4 positions"),
    ({"kind": "padding", "ids": "1,2;3"}, "different lengths [1, 2]"),
    ({"kind": "padding", "ids": "1,2", "lengths": "2"}, "either --lengths or --ids, not both"),
    ({"kind": "padding"}, "padding needs --lengths"),
    # a --tokens count that does not match
    ({"kind": "causal", "length": 3, "tokens": "a b"}, "--tokens has 2 words but the mask has 3 key positions"),
    ({"kind": "prefill", "offset": 2, "length": 1, "tokens": "a"}, "--tokens has 1 words but the mask has 3 key positions"),
    ({"kind": "causal", "tokens": "  "}, "--tokens '  ' has no words"),
    # a window or prefix < 1, or missing, or a prefix longer than the sequence
    ({"kind": "window", "window": 0}, "--window must be at least 1"),
    ({"kind": "window", "window": -2}, "got -2"),
    ({"kind": "window"}, "window needs --window W"),
    ({"kind": "prefix", "prefix": 0}, "--prefix must be at least 1"),
    ({"kind": "prefix"}, "prefix needs --prefix P"),
    ({"kind": "prefix", "prefix": 9, "length": 4}, "--prefix 9 is longer than the sequence (4 tokens)"),
    ({"kind": "causal", "heads": 0}, "--heads must be at least 1"),
    ({"kind": "prefill", "offset": -1}, "--offset must be 0 or more"),
    # an unknown kind, an unknown --means
    ({"kind": "banana"}, "unknown mask kind 'banana': choose one of " + ", ".join(KINDS)),
    ({"kind": "Causal"}, "unknown mask kind 'Causal'"),
    ({"kind": "tril", "means": "maybe"}, "unknown --means 'maybe': choose one of keep, block"),
    # options that belong to another kind are refused, not ignored
    ({"kind": "causal", "window": 3}, "--window 3 does not apply to 'causal'"),
    ({"kind": "causal", "diagonal": 1}, "--diagonal 1 does not apply to 'causal'"),
    ({"kind": "window", "window": 2, "prefix": 1}, "--prefix 1 does not apply to 'window'"),
    ({"kind": "causal", "offset": 2}, "--offset 2 does not apply to 'causal'"),
    ({"kind": "causal", "chunks": "0,1"}, "--chunks 0,1 does not apply to 'causal'"),
]


@pytest.mark.parametrize("kwargs, message", REFUSALS, ids=[str(i) for i in range(len(REFUSALS))])
def test_every_refusal_is_a_mask_error_that_says_what(kwargs, message):
    kwargs = dict(kwargs)
    with pytest.raises(MaskError) as error:
        make_spec(kwargs.pop("kind"), **kwargs)
    assert message in str(error.value)
    assert "\n" not in str(error.value)
    assert isinstance(error.value, ValueError)  # library callers may catch it as a ValueError


def test_spec_does_not_import_torch():
    code = (
        "import sys\n"
        "from maskcli.spec import make_spec\n"
        "make_spec('chunk', chunks='0,0,1', lengths='3,2', tokens='a b c')\n"
        "try:\n    make_spec('window', window=0)\nexcept ValueError:\n    pass\n"
        "print(sorted(m for m in ('torch', 'numpy', 'matplotlib', 'rich', 'typer') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_tokens_give_the_length_when_nothing_else_does():
    words = "Your journey starts with one step"
    spec = make_spec("causal", tokens=words)
    assert (spec.q_len, spec.k_len, spec.tokens) == (6, 6, tuple(words.split()))
    prefill = make_spec("prefill", offset=4, tokens=words)
    assert (prefill.q_len, prefill.k_len) == (2, 6)
    with pytest.raises(MaskError, match="--tokens has 6 words but the mask has 8 key positions"):
        make_spec("causal", length=8, tokens=words)
    with pytest.raises(MaskError, match="leave no new query after --offset 6"):
        make_spec("prefill", offset=6, tokens=words)
