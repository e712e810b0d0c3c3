"""tensorfile/jsontext.py: a .json file or inline JSON, a nested list of numbers (or an object of them) read as numpy
reads np.array(json.loads(text)): integers int64, floats the dtype asked; maskcli's "nan", "inf" and "-inf" read
back as numbers; what is not a rectangular list of numbers is refused saying where."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from maskcli.errors import MaskError
from maskcli.tensorfile import dtype_name, load_tensor, read_tensors
from maskcli.tensorfile.base import Reading
from maskcli.tensorfile.jsontext import parse, read
from tensorfile_cli import refused


def test_numbers_read_as_numpy_reads_the_parsed_lists(tmp_path):
    cells = [[1, 0, 0], [1, 1, 0]]
    (tmp_path / "m.json").write_text(json.dumps(cells))
    got = read(tmp_path / "m.json", "m")[""]
    assert got.dtype == np.int64 and np.array_equal(got, np.array(cells))
    scores = {"bias": [[0.5, "-inf"], ["nan", 1e300]], "ids": [3, 4]}
    (tmp_path / "two.json").write_text(json.dumps(scores))
    got = read(tmp_path / "two.json", "two", Reading(floats="float64"))
    assert got["bias"].dtype == np.float64 and got["bias"][0, 1] == -np.inf and np.isnan(got["bias"][1, 0])
    assert got["bias"][1, 1] == 1e300 and np.array_equal(got["ids"], [3, 4])
    assert np.isinf(read(tmp_path / "two.json", "two")["bias"][1, 1])  # float32 by default: 1e300 is past its range


def test_inline_json_is_read_where_a_file_name_would_be():
    got = read_tensors("[[1, 0], [1, 1]]", "--mask")
    assert list(got) == [""] and np.array_equal(got[""], np.tril(np.ones((2, 2), dtype=np.int64)))
    assert parse('{"a": [[1, 2]], "choices": [[0], [0, 1]]}', "x", lists=("choices",))["choices"] == [[0], [0, 1]]


@pytest.mark.parametrize("text, said", [
    ("[[1, 0], [1]]", "not a rectangular nested list of numbers (its rows differ in length or depth)"),
    ('[[1, "yes"]]', 'not a rectangular nested list of numbers ("yes" is not a number)'),
    ("[[1, 0], [1, 1]", "not valid JSON (Expecting ',' delimiter at line 1 column 16)"),
    ("[[12345678901234567890, 1]]", "(12345678901234567890 does not fit int64)"),
    ("   \n  ", "not valid JSON (Expecting value at line 2 column 3)"),  # only whitespace: was an internal IndexError
])
def test_what_is_no_tensor_of_numbers_is_refused_in_one_line(tmp_path, text, said):
    with pytest.raises(MaskError) as error:
        parse(text, "where")
    assert said in str(error.value) and str(error.value).startswith("where")
    (tmp_path / "bad.json").write_text(text)
    refused(["show", "--mask", tmp_path / "bad.json"], "bad.json", said)


def test_a_byte_order_mark_before_the_json_is_read_past(tmp_path):
    """Windows editors start UTF-8 files with a BOM; json.loads refuses it ("decode using utf-8-sig"), maskcli reads
    the JSON after it."""
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf[[1, 0], [1, 1]]")
    assert read(tmp_path / "bom.json", "bom")[""].tolist() == torch.tril(torch.ones(2, 2, dtype=torch.int64)).tolist()


def test_json_is_read_by_numpy_as_torch_tensor_makes_it():
    for text in ("[[1, 0], [1, 1]]", "[[true, false]]", "[[0.1, -1e39]]", "[[true, 0.5], [1, 0]]", "[7.5, 1]", "[]"):
        (array,) = read_tensors(text, "FILE").values()
        expected = torch.tensor(json.loads(text))
        assert dtype_name(array) == str(expected.dtype).removeprefix("torch.") and array.tolist() == expected.tolist(), text
    assert read_tensors("[[0.1]]", "FILE", json_floats="float64")[""].tolist() == [[0.1]]
    for text, says in (('[[1, null]]', "null is not a number"), (f"[[1, {2 ** 63}]]", f"{2 ** 63} does not fit int64"), (f"[[{-2 ** 63 - 1}]]", f"{-2 ** 63 - 1} does not fit int64"),
                       ('[[{"a": 1}]]', '{"a": 1} is not a number'), ('[[1, "x"]]', '"x" is not a number'),
                       ("[[1, 2], [3]]", "its rows differ in length or depth")):
        with pytest.raises(MaskError, match=re.escape(f"not a rectangular nested list of numbers ({says})")):
            read_tensors(text, "FILE")


def test_json_spellings_of_non_finite_values_load():
    loaded = load_tensor('[["nan", "-inf"], ["inf", 1.0]]', "--q")
    assert torch.isnan(loaded[0, 0]) and loaded[0, 1].item() == float("-inf") and loaded[1, 0].item() == float("inf")
