"""trace/tiled.py: the batch, query and key spans of q @ kᵀ over chunks of tensors the program holds whole, against the
indices the chunks were cut at."""

from __future__ import annotations

import torch

from maskcli.trace.tiled import tile


def test_query_and_key_chunks_split_along_the_sequence_are_placed_at_their_starts():
    q = torch.randn(2, 3, 16, 8)
    kv = torch.randn(2, 16, 2 * 3 * 8)  # one projection, keys and values viewed out of it per head
    k = kv.chunk(2, dim=-1)[0].view(2, 16, 3, 8).transpose(1, 2)
    for i, qi in enumerate(q.split(4, dim=-2)):
        for j, kj in enumerate(k.split(4, dim=-2)):
            assert tile(qi, kj) == [[0, 2], [4 * i, 16], [4 * j, 16]]
            assert tile(qi, kj.transpose(-2, -1), turned=True) == [[0, 2], [4 * i, 16], [4 * j, 16]]


def test_index_slices_and_batch_chunks():
    x = torch.randn(2, 12, 3 * 4 * 6)
    q, k, _ = x.view(2, 12, 3, 4, 6).permute(2, 0, 3, 1, 4)
    assert tile(q[:, :, 8:12], k[:, :, 4:8]) == [[0, 2], [8, 12], [4, 12]]
    merged = torch.randn(2, 4, 16, 8).reshape(8, 16, 8)  # a batch folded with its heads, chunked by rows
    for n, chunk in enumerate(merged.chunk(4, dim=0)):
        assert tile(chunk[:, 0:16], torch.randn(2, 16, 8)) == [[2 * n, 8], [0, 16], [0, 16]]


def test_whole_tensors_are_no_tile():
    x = torch.randn(2, 12, 3 * 4 * 6)
    q, k, _ = x.view(2, 12, 3, 4, 6).permute(2, 0, 3, 1, 4)  # views, but of every row, query and key
    assert tile(q, k) is None
    assert tile(torch.randn(2, 4, 12, 6), torch.randn(2, 4, 12, 6)) is None


def test_a_sequence_cut_into_windows_is_no_tile():
    q = torch.randn(4, 16, 8)
    windows = q.reshape(4, 4, 4, 8)  # (b, windows, w, d): every query, in blocks (local-attention's bucketing)
    assert tile(windows, torch.randn(4, 4, 8, 8)) is None


def test_a_chunk_of_a_linear_output_merged_over_batch_and_sequence_is_placed():
    flat = torch.randn(2 * 12, 72)  # nn.Linear's (B * L, features) output, viewed back as (B, L, features)
    _, k, _ = flat.view(2, 12, 3, 3, 8).permute(2, 0, 3, 1, 4)
    q = torch.randn(2, 3, 12, 8)
    assert tile(q[:, :, 8:12], k[:, :, 4:8].transpose(-2, -1), turned=True) == [[0, 2], [8, 12], [4, 12]]
