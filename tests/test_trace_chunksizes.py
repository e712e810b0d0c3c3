"""trace/chunksizes.py: the chunk sizes a streaming model keeps beside its causal flag, read off its own attributes."""

from __future__ import annotations

import torch

from maskcli.trace.chunksizes import chunk_sizes


class Encoder(torch.nn.Module):
    def __init__(self, **own):
        super().__init__()
        for name, value in own.items():
            setattr(self, name, value)


def test_an_int_or_a_tuple_of_int_chunk_sizes_are_read_with_where_they_are_said():
    assert chunk_sizes(Encoder(causal=True, chunk_size=(16, 32, -1))) == {
        "model_chunks": ((16, 32, -1), "Encoder.chunk_size")}
    assert chunk_sizes(Encoder(causal=True, static_chunk_size=4)) == {"model_chunks": ((4,), "Encoder.static_chunk_size")}


def test_no_chunk_size_a_bool_a_float_or_an_empty_tuple_says_nothing():
    for own in ({}, {"chunk_size": True}, {"chunk_size": 4.0}, {"chunk_size": ()}, {"chunk_size": (4, "8")},
                {"window_size": 4}):
        assert chunk_sizes(Encoder(causal=True, **own)) == {}, own
