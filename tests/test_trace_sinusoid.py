"""trace/sinusoid.py: the positions a sinusoidal encoding added to a model's inputs stands for."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from maskcli.trace.sinusoid import candidate, positions


def interleaved(at: list, width: int) -> torch.Tensor:
    """The Annotated Transformer's table (a double loop, written here): sin at even columns, cos at odd ones."""
    rows = torch.zeros(len(at), width)
    for r, p in enumerate(at):
        for i in range(0, width, 2):
            angle = p / 10000 ** (i / width)
            rows[r, i], rows[r, i + 1] = math.sin(angle), math.cos(angle)
    return rows


def halves(at: list, width: int) -> torch.Tensor:
    """tensor2tensor's timing signal (OpenNMT-tf's, fairseq's): sines in the first half, cosines in the second."""
    n = width // 2
    rows = torch.zeros(len(at), width)
    for r, p in enumerate(at):
        for i in range(n):
            angle = p * math.exp(-i * math.log(10000) / (n - 1))
            rows[r, i], rows[r, n + i] = math.sin(angle), math.cos(angle)
    return rows


@pytest.mark.parametrize("table", [interleaved, halves])
@pytest.mark.parametrize("width", [8, 32, 512])
def test_each_row_reads_back_as_its_position(table, width):
    """Up to one turn of the slowest pair (10000^-(d-2)/d a position interleaved: 6,283 positions at width 8)."""
    at = [0, 1, 2, 7, 63, 1000, 4097, *([30000] if width > 8 else [])]
    assert positions(table(at, width)).tolist() == at


def test_rows_of_no_such_encoding_read_as_none():
    assert positions(torch.randn(5, 32)) is None
    assert positions(interleaved([0, 1, 2], 32) * 2) is None  # (scaled: its pairs' squares sum to 4)
    assert positions(torch.cat([interleaved([3], 16), interleaved([3], 16)[:, [1, 0] * 8]], 0)) is None


def test_the_shapes_a_position_encoding_is_added_in():
    x = torch.randn(2, 5, 32)
    assert candidate((x, interleaved(range(5), 32)[None]), x)  # (broadcast over the batch)
    buffer = interleaved(range(10), 32)[None]
    assert candidate((x[:1], buffer[:, 3:8]), x[:1])  # (a slice of a larger table, batch of one)
    assert not candidate((x, torch.randn(2, 5, 32)), x)  # (a residual's sum: equal shapes)
    weight = torch.nn.Parameter(torch.randn(1, 5, 32))
    assert not candidate((x, weight), x)  # (a learned position embedding: it needs a gradient)
    assert not candidate((torch.randn(2, 5, 6), torch.randn(5, 6)), torch.randn(2, 5, 6))  # (too narrow)


def test_a_batch_positions_are_not_read_from_a_table_that_varies_by_row():
    from maskcli.trace.sinusoid import _rows
    two = torch.stack([interleaved([0, 1], 16), interleaved([5, 6], 16)])
    assert _rows(two) is None and np.array_equal(_rows(two[:1]).numpy(), interleaved([0, 1], 16).numpy())
