"""maskcli.jsonarrays: numpy's reading of a JSON nested list of numbers is json's reading, or None.

The reference is Python's own json module (json.loads, then np.array, with maskcli's "nan"/"inf"/"-inf" strings
as floats): on random rectangular arrays written with random spacing, the fast path must give the same array; on
random one-character damage of such texts, whatever it accepts json must accept and read the same.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maskcli.jsonarrays import dense_numbers

CONSTANTS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def by_json(text: str) -> np.ndarray:
    def convert(value):
        if isinstance(value, list):
            return [convert(item) for item in value]
        return CONSTANTS[value] if isinstance(value, str) else value

    return np.array(convert(json.loads(text)))


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


numbers = st.one_of(
    st.integers(-(2**62), 2**62),
    st.integers(0, 1),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
)


def written(value, spaces) -> str:
    """`value` as JSON, non-finite numbers as maskcli's strings, with whitespace drawn from `spaces` around items."""
    if isinstance(value, list):
        gap = next(spaces)
        return "[" + gap + ("," + next(spaces)).join(written(item, spaces) for item in value) + next(spaces) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps("nan" if math.isnan(value) else "inf" if value > 0 else "-inf")
    return json.dumps(value)


@st.composite
def arrays(draw):
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    kind = draw(st.sampled_from(["bits", "ints", "floats", "mixed"]))
    count = int(np.prod(shape))
    element = {"bits": st.integers(0, 1), "ints": st.integers(-(2**62), 2**62), "floats": numbers, "mixed": numbers}[kind]
    flat = draw(st.lists(element, min_size=count, max_size=count))
    nested = np.array(flat, dtype=object).reshape(shape).tolist()
    gaps = draw(st.lists(st.sampled_from(["", "", " ", "\n", " \t", "\r\n  "]), min_size=1, max_size=8))
    spaces = iter(gaps * (8 * count + 64))
    return written(nested, spaces)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays())
def test_a_rectangular_list_of_numbers_reads_as_json_reads_it(text):
    found = dense_numbers(text)
    assert found is not None, text
    assert same(found, by_json(text)), text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays(), st.data())
def test_whatever_the_fast_path_takes_json_takes_and_reads_the_same(text, data):
    at = data.draw(st.integers(0, len(text)))
    how = data.draw(st.sampled_from(["delete", "insert", "replace"]))
    char = data.draw(st.sampled_from(list('[],0123456789-+.eE "infa\nxt')))
    damaged = {"delete": text[:at] + text[at + 1:], "insert": text[:at] + char + text[at:], "replace": text[:at] + char + text[at + 1:]}[how]
    found = dense_numbers(damaged)
    if found is None:
        return
    assert same(found, by_json(damaged)), damaged  # json.loads raises here if the fast path took bad JSON


@pytest.mark.parametrize("text", [
    "[1 2]", "[1,,2]", "[1,]", "[,1]", "[01]", "[-01]", "[1.]", "[.5]", "[+1]", "[1e]", "[1e+]", "[1.2.3]", "[1e5e3]",
    "[1e5.3]", "[inf]", '[-"inf"]', '[1"inf"]', '["inf"2]', '["nan""inf"]', "[1]]", "[[1]", "[1-2]", "[--1]", "[-]",
    "[1,2]x", "[[1],[2]],[3]", "[1 , , 2]", "[[1] [2]]", "[[1][2]]",
])
def test_text_json_refuses_is_left_to_json(text):
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert dense_numbers(text) is None


@pytest.mark.parametrize("text", [
    "[[1],2]", "[[1,2],[3]]", "[]", "[[]]", '["x"]', "[true]", "[null]", '{"a":[1]}', "1", "[12345678901234567890]",
    "[-12345678901234567890]", '["Inf"]', "[9223372036854775807]",
])
def test_json_that_is_not_a_plain_array_of_numbers_goes_the_general_way(text):
    json.loads(text)  # valid JSON: the general path reads it, or words why it is no tensor
    assert dense_numbers(text) is None


def test_a_tutorial_mask_is_read_whole():
    keep = np.tril(np.ones((512, 512), dtype=np.int64))
    text = json.dumps(keep.tolist(), separators=(",", ":"))
    assert same(dense_numbers(text), keep)


def test_an_integer_past_int64_beside_a_float_reads_as_json_reads_it():
    # hypothesis found it: json keeps -9223372036854775810 a Python int beside 0.0 (an object array); the fast path's
    # float64 would round it
    for text in ("[[0.0,-9223372036854775810]]", "[1.5, 9223372036854775808]"):
        found = dense_numbers(text)
        assert found is None or same(found, by_json(text)), text
    assert same(dense_numbers("[1.5, 9223372036854775807, 2e3]"), by_json("[1.5, 9223372036854775807, 2e3]"))
