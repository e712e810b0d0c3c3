"""mask-rows-same-shard (checks/maskrows.py): shards of one sequence that all take the same block of rows of the one
square mask over their keys; and what trace/maskrows.py records of a mask handed as a block of rows."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

import maskcli
from checkbugs import check_bug

MASKROWS = Path(__file__).parent / "data" / "maskrows"


def _rows_reference(full: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Rows start .. start + n - 1 of a (L, L) mask, copied by a double loop over positions (the tests' reference)."""
    out = torch.zeros(n, full.shape[1], dtype=full.dtype)
    for q in range(n):
        for k in range(full.shape[1]):
            out[q, k] = full[start + q, k]
    return out


def test_cornstarch_ranks_take_rank_zero_rows(tmp_path):
    """Cornstarch#38 (written blind): 4 context-parallel ranks of 8 queries over all 32 gathered keys each take rows
    0 .. 7 of the (32, 32) causal + image-block mask. The fix (each rank's rows at its offset) is quiet."""
    found = check_bug(tmp_path, "cornstarch_context_parallel_mask_rows_from_top_not_rank_offset", "mask-rows-same-shard")
    full = torch.ones(32, 32, dtype=torch.bool).tril()
    for a, b in ((4, 12), (20, 26)):
        full[a:b, a:b] = True
    assert not torch.equal(_rows_reference(full, 0, 8), _rows_reference(full, 8, 8))  # (rank 1's rows are others)
    message = found[0]["message"]
    assert "4 calls of ContextParallelAttention (steps 0 .. 3) each attend 8 queries of their own to the same 32 keys" \
        in message
    assert "rows 0 .. 7 of the one (32, 32) mask" in message
    assert found[0]["expected"] == "call 2 of the shards: rows 8 .. 15 of the mask"


def test_padded_float_mask_two_ranks_take_the_top_rows(tmp_path):
    """Written another way: a (B, 1, L, L) float additive mask over a left-padded batch of two, two ranks of 6 queries,
    `attention_mask[..., :sq, :]` on both. The fix (`[..., rank * sq:(rank + 1) * sq, :]`) is quiet."""
    found = check_bug(tmp_path, "ring_cp_padded_float_mask_rows_from_top", "mask-rows-same-shard", MASKROWS)
    assert "2 x 6 = 12" in found[0]["message"]
    assert found[0]["expected"] == "call 2 of the shards: rows 6 .. 11 of the mask"


def _traced(masks, q_len=4, k_len=8):
    """The mask_rows_of each SDPA call records, one call per mask (other queries each call)."""
    with maskcli.trace() as t:
        k = v = torch.randn(1, 1, k_len, 4)
        for mask in masks:
            F.scaled_dot_product_attention(torch.randn(1, 1, q_len, 4), k, v, attn_mask=mask)
    return [c.details.get("mask_rows_of") for g in t.groups() for c in g.calls], t


def test_recorded_rows_against_the_slice():
    """A row block of a square bool mask is recorded at its start (the start the slice was written with); a key slice,
    a copy and a full mask are not."""
    full = torch.ones(8, 8, dtype=torch.bool).tril()
    said, _ = _traced([full[None, None, 4:8], full[None, None, 4:8].clone()])
    assert said[0][1:] == (4, 8, True) and said[1] is None
    assert torch.equal(full[4:8], _rows_reference(full, 4, 4))
    wide = torch.ones(8, 16, dtype=torch.bool)
    said, _ = _traced([wide[:4, :8]], 4, 8)  # (a key slice of a wider mask: no square base)
    assert said == [None]


def test_each_shard_at_its_offset_or_rows_all_alike_are_quiet():
    """Shards at their own offsets, and a key padding repeated over the queries (every row block alike), are quiet."""
    full = torch.ones(8, 8, dtype=torch.bool).tril()
    _, t = _traced([full[None, None, 0:4], full[None, None, 4:8]])
    assert not [f for g in t.groups() for f in g.findings if f.code == "mask-rows-same-shard"]
    pad = torch.tensor([True] * 6 + [False] * 2).expand(8, 8)[None, None].contiguous()
    said, t = _traced([pad[..., 0:4, :], pad[..., 0:4, :]])
    assert said[0][3] is False
    assert not [f for g in t.groups() for f in g.findings if f.code == "mask-rows-same-shard"]
    _, t = _traced([full[None, None, 0:4], full[None, None, 0:4]])
    assert [f.code for g in t.groups() for f in g.findings if f.code == "mask-rows-same-shard"] == ["mask-rows-same-shard"]
