"""maskcli.shard.layouts against PyTorch's context-parallel load balancers, which are plain index code on the CPU.

The balancers live in torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py (torch 2.13):
_HeadTailLoadBalancer._generate_indices (lines 146-164), _PerDocumentHeadTailLoadBalancer (lines 251-292) and
_PTRRLoadBalancer (lines 369-467); none needs a process group. _context_parallel_buffers shards the rearranged
sequence into equal contiguous parts, one per rank (DTensor Shard(seq_dim), _attention.py:1151-1155).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.distributed.tensor.experimental._attention import (
    _HeadTailLoadBalancer,
    _PerDocumentHeadTailLoadBalancer,
    _PTRRLoadBalancer,
)

from maskcli.errors import MaskError
from maskcli.shard import layouts


def sets_of(layout):
    return [layout.rank_indices(r).tolist() for r in range(layout.ranks)]


@pytest.mark.parametrize("length, ranks", [(16, 2), (48, 4), (64, 8), (24, 3)])
def test_headtail_is_pytorchs_head_tail_balancer(length, ranks):
    torch_order = _HeadTailLoadBalancer(length, ranks, "cpu")._generate_indices()[0].numpy()
    found = layouts.headtail(length, ranks)
    assert found.indices().tolist() == torch_order.tolist()
    assert sets_of(found) == [part.tolist() for part in np.split(torch_order, ranks)]
    assert len(found.rank) <= 2 * ranks  # runs, not tokens


@pytest.mark.parametrize("docs, ranks", [([4, 8, 4], 2), ([16, 48, 8], 4), ([12], 3)])
def test_per_document_takes_each_ranks_chunks_of_every_document_from_pytorchs_balancer(docs, ranks):
    # the balancer appends, per document and per rank, the head chunk then the tail chunk (_load_balancer.py:264-284)
    torch_order = _PerDocumentHeadTailLoadBalancer([docs], ranks, "cpu")._generate_indices()[0].numpy()
    expected = [[] for _ in range(ranks)]
    at = 0
    for size in docs:
        chunks = np.split(torch_order[at:at + size], 2 * ranks)
        for r in range(ranks):
            expected[r] += chunks[2 * r].tolist() + chunks[2 * r + 1].tolist()
        at += size
    assert sets_of(layouts.per_document(docs, ranks)) == expected


def test_pytorchs_per_document_order_sharded_as_pytorch_shards_it_is_document_major():
    # its indices go document by document, so the equal contiguous parts _context_parallel_buffers takes give
    # rank 0 the first documents, not chunks r and 2N-1-r of each one as the class docstring draws (lines 222-242)
    torch_order = _PerDocumentHeadTailLoadBalancer([[16, 48]], 2, "cpu")._generate_indices()[0].numpy()
    read = layouts.from_indices(list(np.split(torch_order, 2)), 64, "torch")
    assert set(read.rank_indices(0).tolist()) >= set(range(16))  # all of document 0 on rank 0
    assert sets_of(read) != sets_of(layouts.per_document([16, 48], 2))


@pytest.mark.parametrize("length, ranks", [(16, 4), (10, 3), (7, 8)])
def test_contiguous_is_equal_slices_with_the_tail_padded(length, ranks):
    found = layouts.contiguous(length, ranks)
    per = -(-length // ranks)
    padded = list(range(length)) + [-1] * (per * ranks - length)
    assert sets_of(found) == [padded[r * per:(r + 1) * per] for r in range(ranks)]
    if length % ranks == 0:  # torch.chunk's equal parts, as DTensor's Shard(0) takes them
        assert sets_of(found) == [c.tolist() for c in torch.arange(length).chunk(ranks)]


@pytest.mark.parametrize("length, ranks, width", [(12, 3, 1), (20, 2, 4), (10, 4, 2)])
def test_striped_deals_stripes_round_robin(length, ranks, width):
    found = layouts.striped(length, ranks, width)
    for r in range(ranks):
        mine = [p for p in found.rank_indices(r).tolist() if p >= 0]
        assert mine == [p for p in range(length) if (p // width) % ranks == r]
    assert found.period == ranks * width


def test_headtail_pads_the_tail_to_a_multiple_of_2n_and_keeps_every_token():
    found = layouts.headtail(13, 2)  # 16 slots: chunks of 4; rank 0's tail chunk 12..15 holds 12 and 3 pads
    assert sets_of(found) == [[0, 1, 2, 3, 12, -1, -1, -1], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert found.tokens().tolist() == [5, 8] and found.slots().tolist() == [8, 8]
    assert found.indices().tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]


def test_ulysses_splits_heads_and_refuses_fewer_heads_than_ranks():
    assert layouts.ulysses(16, 4, 8).heads == (2, 2, 2, 2)
    assert sum(layouts.ulysses(16, 4, 6).heads) == 6
    with pytest.raises(MaskError, match="--heads 2 is fewer than --ranks 4"):
        layouts.ulysses(16, 4, 2)


def test_ptrr_indices_read_from_a_file_as_pytorch_shards_them(tmp_path):
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b, h, q, kv):
        doc = torch.tensor([0] * 128 + [1] * 384)
        return (doc[q] == doc[kv]) & (kv <= q)

    block_mask = create_block_mask(document_causal, 1, 1, 512, 512, device="cpu")
    order = _PTRRLoadBalancer(block_mask, 2)._generate_indices()
    torch.save(order, tmp_path / "ptrr.pt")
    found = layouts.read_file(str(tmp_path / "ptrr.pt"), 512, 2)
    assert sets_of(found) == [part.tolist() for part in np.split(order[0].numpy(), 2)]
    assert len(found.rank) <= 4  # 4 blocks of 128: runs of blocks, not tokens


def test_read_file_forms(tmp_path):
    (tmp_path / "lists.json").write_text(json.dumps([[0, 3], [1, 2]]))
    (tmp_path / "ranks.json").write_text(json.dumps({"1": [1, 2], "0": [0, 3]}))
    np.save(tmp_path / "perm.npy", np.array([0, 3, 1, 2]))
    for name in ("lists.json", "ranks.json", "perm.npy"):
        assert sets_of(layouts.read_file(str(tmp_path / name), 4, 2)) == [[0, 3], [1, 2]], name


@pytest.mark.parametrize("content, message", [
    ([0, 1, 2], "holds 3 indices, not a multiple of --ranks 2"),
    ([[0], [1], [2]], "index lists for 3 ranks but --ranks is 2"),
    ([[0.5, 1], [2, 3]], "not whole numbers"),
])
def test_read_file_errors_quote_the_file(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(MaskError, match=message):
        layouts.read_file(str(path), 4, 2)
    with pytest.raises(MaskError, match="no such file"):
        layouts.read_file(str(tmp_path / "none.json"), 4, 2)


@pytest.mark.parametrize("name, write, message", [
    ("garbage.pt", lambda p: p.write_bytes(b"not a tensor"), "cannot read --layout '.*garbage.pt': not a tensor file"),
    ("ragged.json", lambda p: p.write_text("[1, 2, [3]]"), "holds list values, not index lists"),
    ("empty.txt", lambda p: p.write_text(""), "is empty: give a permutation"),
    ("text.pt", lambda p: __import__("torch").save("hello", p), "values, not index lists"),
    ("one.json", lambda p: p.write_text(json.dumps({"0": [0, 1, 2, 3]})), "index lists for 1 rank but --ranks is 2"),
])
def test_unreadable_index_files_are_one_mask_error(tmp_path, name, write, message):
    # each of these raised a bare UnpicklingError, ValueError, IndexError or AttributeError before
    path = tmp_path / name
    write(path)
    with pytest.raises(MaskError, match=message):
        layouts.read_file(str(path), 4, 2)


@pytest.mark.parametrize("expr, ranks", [("document(sizes=[64,192,128,128]) & window(100)", 2), ("causal | sink(8)", 4)])
def test_ptrr_is_pytorchs_ptrr_balancer_on_the_masks_blocks(expr, ranks):
    from torch.nn.attention.flex_attention import create_block_mask

    from maskcli import build
    from maskcli.shard.plan import make_layout

    mask = build(expr, length=512)
    block_mask = create_block_mask(mask.mask_mod, 1, 1, 512, 512, device="cpu", BLOCK_SIZE=64)
    torch_order = _PTRRLoadBalancer(block_mask, ranks)._generate_indices()[0].numpy()
    found = make_layout("ptrr:64", 512, ranks, 1, None, mask)
    assert found.indices().tolist() == torch_order.tolist()
    with pytest.raises(MaskError, match="do not divide among 3 ranks"):
        make_layout("ptrr:64", 512, 3, 1, None, mask)


def test_the_note_counts_one_slot_in_the_singular():
    assert layouts.contiguous(8, 8).note == "1 slot a rank"  # it said "1 slots a rank"
    assert layouts.contiguous(9, 8).note == "2 slots a rank"


@pytest.mark.parametrize("length, ranks", [(16, 2), (48, 4), (64, 8)])
def test_headtail_is_megatron_cores_per_rank_batch_split(monkeypatch, length, ranks):
    """megatron-core's get_batch_on_this_cp_rank (megatron/core/utils.py:1994-2037, megatron-core 0.16.1) views each
    tensor's sequence as 2 x cp_size chunks and keeps chunks cp_rank and 2 x cp_size - cp_rank - 1, in that order; an
    attention_mask (b, 1, q, kv) is cut along its query rows (seq_dim 2) and keeps every key. It reads the CP size and
    rank from parallel_state where no group is given, so they are set here; it needs no process group or GPU.
    Optional: megatron-core is not a dependency (pip install megatron-core)."""
    from maskcli import build
    from maskcli.shard import work

    utils = pytest.importorskip("megatron.core.utils", reason="megatron-core is not installed (pip install megatron-core)")
    layout = layouts.headtail(length, ranks)
    expr = "causal & window(5)"
    cells = work.split(build(expr, length=length), layout).cells
    q = torch.arange(length)
    keep = (q[:, None] >= q[None, :]) & (q[:, None] - q[None, :] < 5)  # causal & window(5) by hand
    for r in range(ranks):
        monkeypatch.setattr(utils.parallel_state, "get_context_parallel_world_size", lambda: ranks)
        monkeypatch.setattr(utils.parallel_state, "get_context_parallel_rank", lambda r=r: r)
        batch = utils.get_batch_on_this_cp_rank({"tokens": q[None, :].clone(), "attention_mask": keep[None, None].clone()})
        assert batch["tokens"][0].tolist() == layout.rank_indices(r).tolist()
        assert int(batch["attention_mask"].sum()) == cells[r]  # rank r's rows, every key: its share of the work
