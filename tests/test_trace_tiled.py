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


def test_one_sample_of_a_batch_indexed_away_is_that_samples_rows_with_all_its_queries():
    """q[i] of a (B, L, H, D) projection with the batch indexed away (a loop over the batch handing a kernel one
    sample's heads: tunix's vmapped splash kernel) is rows i*H .. i*H + H - 1 of the batch folded with its heads
    batch-major, every query and key its own, not queries i*L .. of a (B L) stream."""
    batch, length, heads, dim = 3, 10, 4, 8
    x = torch.randn(batch, length, heads * dim)
    q = x.view(batch, length, heads, dim).transpose(1, 2)  # (B, H, L, D)
    k = torch.randn(batch, length, heads * dim).view(batch, length, heads, dim).transpose(1, 2)
    for i in range(batch):
        assert tile(q[i], k[i]) == [[i * heads, batch * heads], [0, length], [0, length]]
        assert tile(q[i], k[i].transpose(-2, -1), turned=True) == [[i * heads, batch * heads], [0, length], [0, length]]
    # a query chunk of one sample stays a chunk of its own queries' (the batch axis kept: no sample read)
    assert tile(q[:, :, 4:8], k) == [[0, batch], [4, length], [0, length]]


def test_sdpa_handed_one_samples_heads_is_that_samples_row():
    """one_sample: SDPA's 3-D q and k (H, L, D), one sample's heads of a batch indexed away, are sample i of B (its
    one row, the heads on their own axis); a sample's query chunk, a whole tensor and q and k of different samples
    are none."""
    from maskcli.trace.tiled import one_sample

    batch, length, heads, dim = 2, 6, 4, 8
    x = torch.nn.Linear(16, 3 * heads * dim, bias=False)(torch.randn(batch, length, 16))
    q, k, _ = x.view(batch, length, 3, heads, dim).permute(2, 0, 3, 1, 4)  # each (B, H, L, D)
    for i in range(batch):
        assert one_sample(q[i], k[i]) == [[i, batch], [0, length], [0, length]]
    assert one_sample(q[0], k[1]) is None
    assert one_sample(q[0][:, :3], k[0]) is None
    assert one_sample(torch.randn(heads, length, dim), torch.randn(heads, length, dim)) is None
