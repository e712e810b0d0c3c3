"""Integer lists as kinds and flags take them: inline rows, segment sizes, files."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from maskcli.errors import MaskError
from maskcli.kinds.values import from_file, from_flag, from_sizes, inline, parse_rows
from tensorfile_cli import refused

FAST = settings(max_examples=60, deadline=None)
ints = st.integers(min_value=-(10**15), max_value=10**15)
blank = st.sampled_from(["", " ", "  ", "\t"])
INTEGER = re.compile(r"\s*[+-]?[0-9]+\s*")
bad_items = st.text(alphabet="abxyz.e/-+ 1", min_size=1, max_size=5).filter(lambda item: item.strip() and not INTEGER.fullmatch(item))


@FAST
@given(data=st.data(), width=st.integers(1, 6))
def test_rows_round_trip_with_spaces_anywhere(data, width):
    rows = data.draw(st.lists(st.lists(ints, min_size=width, max_size=width), min_size=1, max_size=4))
    text = ";".join(",".join(data.draw(blank) + str(v) + data.draw(blank) for v in row) for row in rows)
    assert [row.tolist() for row in parse_rows(text, "--ids")] == rows


@FAST
@given(data=st.data(), values=st.lists(ints, max_size=6), bad=bad_items)
def test_a_non_integer_is_quoted_with_its_position(data, values, bad):
    position = data.draw(st.integers(0, len(values)))
    items = [str(v) for v in values]
    items.insert(position, bad)
    text = ",".join(items)
    with pytest.raises(MaskError) as error:
        parse_rows(text, "--chunks")
    message = str(error.value)
    assert message.startswith(f"--chunks: {bad.strip()!r} at position {position} of {text!r} is not an integer")
    assert "\n" not in message


@pytest.mark.parametrize("text", ["", " ", ",", " , ,  ", ";", "\t"])
def test_nothing_is_refused_as_empty(text):
    with pytest.raises(MaskError, match="no values: give comma-separated integers"):
        parse_rows(text, "--chunks")


def test_an_empty_batch_row_and_rows_of_different_lengths():
    with pytest.raises(MaskError, match="batch row 1 of '1,2;' is empty"):
        parse_rows("1,2;", "--ids")
    with pytest.raises(MaskError, match="the batch rows have 2, 1 values, in that order"):
        inline(parse_rows("1,2;3", "--chunks"), "--chunks")
    with pytest.raises(MaskError, match="too large for a label"):
        inline([[10**30]], "chunk(...)")


@FAST
@given(rows=st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=4), min_size=1, max_size=3))
def test_sizes_give_one_label_per_segment(rows):
    assume(len({sum(row) for row in rows}) == 1)
    labels = from_sizes(rows, "sizes")
    for row, sizes in zip(labels.array.tolist(), rows):
        assert row == [i for i, size in enumerate(sizes) for _ in range(size)]
    assert labels.text == "sizes=[" + ";".join(",".join(map(str, r)) for r in rows) + "]"


def test_labels_from_sizes_are_made_on_first_use(monkeypatch):
    # (they are refused up front where they would not fit once made: here the host is said to have room, so that the
    # test does not depend on what else the machine runs)
    monkeypatch.setattr("maskcli.memory.available_memory", lambda device=None: 1 << 40)
    labels = from_sizes([[10**9]], "sizes")  # 8 GB of labels, were they made now
    assert (labels.rows, labels.length) == (1, 10**9) and "array" not in labels.__dict__
    small = from_sizes([[2, 1], [1, 2]], "sizes")
    assert (small.rows, small.length) == (2, 3) and small.array.tolist() == [[0, 0, 1], [0, 1, 1]]
    assert small == from_sizes([[2, 1], [1, 2]], "again") and small != from_sizes([[1, 2], [2, 1]], "sizes")


def test_sizes_must_cover_the_same_positions_and_be_positive():
    with pytest.raises(MaskError, match="add up to different lengths"):
        from_sizes([[1, 2], [2, 2]], "sizes")
    with pytest.raises(MaskError, match="at least 1, got 0"):
        from_sizes([[0, 3]], "sizes")


def test_flags_take_inline_values_or_a_file(tmp_path):
    assert from_flag("0,0,1", "--chunks").array.tolist() == [[0, 0, 1]]
    assert from_flag("2,1", "--sizes", sizes=True).array.tolist() == [[0, 0, 1]]
    np.save(tmp_path / "l.npy", np.array([[0, 1], [1, 1]]))
    assert from_flag(str(tmp_path / "l.npy"), "--chunks").array.tolist() == [[0, 1], [1, 1]]


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("l.json", "[0.5, 1]", "labels must be whole numbers, one per position; got float64 values such as 0.5: save integer"),
        ("l.json", "[1, NaN]", "got float64 values such as nan: save integer labels"),
        ("l.json", "{", "cannot read labels"),
        ("l.json", "[[[1]]]", "got shape [1, 1, 1]"),
        ("l.txt", "0 a 1", "'a' is not an integer"),
        ("l.csv", "0,1", "unknown file type '.csv'"),
    ],
)
def test_bad_label_files_say_why(tmp_path, name, content, says):
    (tmp_path / name).write_text(content)
    with pytest.raises(MaskError, match=re.escape(says)):
        from_file(str(tmp_path / name), "document(...)")


def test_a_txt_file_takes_a_line_or_a_semicolon_per_batch_row(tmp_path):
    from maskcli.kinds.values import from_file

    (tmp_path / "rows.txt").write_text("0,0,1,1;0,1,1,1\n")
    (tmp_path / "lines.txt").write_text("0 0 1 1\n0 1 1 1\n")
    for name in ("rows.txt", "lines.txt"):
        assert from_file(str(tmp_path / name), "--chunks").array.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]


def test_a_mask_file_given_for_labels_is_refused_not_read_as_labels_1_and_0(tmp_path):
    """hunt 10: `maskcli chunk keep.pt` (a bool mask where labels go) drew the chunk mask of labels 1/0, exit 0."""
    import torch

    torch.save(torch.tril(torch.ones(4, 4, dtype=torch.bool)), tmp_path / "keep.pt")
    np.save(tmp_path / "flags.npy", np.array([True, False, True]))
    (tmp_path / "flags.json").write_text("[true, false, true]")
    for name in ("keep.pt", "flags.npy", "flags.json"):
        with pytest.raises(MaskError, match=re.escape("holds True/False (a bool")):
            from_file(str(tmp_path / name), "--chunks")
    refused(["chunk", tmp_path / "keep.pt"], "chunk labels '", "keep.pt': holds True/False (a bool [4, 4] tensor: a mask, not labels?): give integer labels, one per position")


@pytest.mark.parametrize(("name", "content"), [("l.txt", "0\t0\n1\r\n1\n"), ("l.txt", "0,0;1,1,1"), ("l.json", "[[0, 0], [1], [1]]")])
def test_label_files_with_rows_of_different_lengths_say_so_as_inline_labels_do(tmp_path, name, content):
    """hunt 10: a file's ragged rows were "cannot read labels from it (setting an array element with a sequence. The
    requested array has an inhomogeneous shape after 1 dimensions ...)", numpy's words, not how to fix it."""
    (tmp_path / name).write_text(content)
    widths = "2, 1, 1" if name == "l.json" or "\t" in content else "2, 3"
    said = f"the batch rows have {widths} values, in that order: give every batch row one value per position"
    refused(["chunk", tmp_path / name], f"{name}': {said}")


@pytest.mark.parametrize(("text", "item"), [("1_0,2", "1_0"), ("\uff10,\uff11", "\uff10"), ("0,0;1,\u0664", "\u0664")])
def test_inline_integers_are_digits_0_to_9_as_len_takes_them(text, item):
    """hunt 10: numpy read '1_0' as 10 and fullwidth or Arabic-Indic digits as numbers, so `chunk 1_0,2` drew labels
    10,2 (and --lengths 4,1_0 lengths 4,10), where --len '1_0' and the expression parser refuse it."""
    position = text.replace(";", ",").split(",").index(item)
    refused(["chunk", text], f"chunk labels {text!r}: {item!r} at position {position} of {text!r} is not an integer (write them like 0,0,1,1)")
    with pytest.raises(MaskError, match="is not an integer"):
        parse_rows(text, "--lengths")


@pytest.mark.parametrize("args, where", [(["show", "causal", "--ids", "FILE"], "--ids"), (["show", "segment", "--chunks", "FILE"], "FILE"),
                                         (["show", "padding", "--len", 3, "--lengths", "FILE"], "--lengths")])
def test_a_whole_float_past_int64_in_a_labels_file_is_refused_with_its_value(tmp_path, args, where):
    """hunt 11: 1e300 in a JSON of ids or labels was cast to -9223372036854775808 (a RuntimeWarning, then a mask on
    that label, exit 0; --lengths quoted the wrapped value)."""
    path = tmp_path / "labels.json"
    for text, quoted in (("[1e300, 0, 0]", "1e+300"), ("[0, -1e300, 0]", "-1e+300")):
        path.write_text(text)
        line = refused([path if a == "FILE" else a for a in args], f"a label is too large ({quoted}; at most ±4,611,686,018,427,387,904)")
        assert "9223372036854775808" not in line
