"""maskcli.shard.work against double loops over absolute positions: each rank's cells, the ring-step grid,
the imbalance, and the local cu_seqlens."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maskcli import build
from maskcli.errors import MaskError
from maskcli.shard import layouts, work


def reference(expr: str, length: int, layout) -> tuple[np.ndarray, np.ndarray]:
    """(cells per rank, cells of rank r's rows against rank s's keys) by a double loop over positions,
    the mask read through its FlexAttention predicate (torch), not its intervals."""
    import torch

    mask = build(expr, length=length)
    mod = mask.mask_mod
    owner = {}
    for r in range(layout.ranks):
        for p in layout.rank_indices(r).tolist():
            if p >= 0:
                owner[p] = r
    grid = np.zeros((layout.ranks, layout.ranks), dtype=np.int64)
    zero = torch.tensor(0)
    for q in range(length):
        for k in range(length):
            if bool(mod(zero, zero, torch.tensor(q), torch.tensor(k))):
                grid[owner[q], owner[k]] += 1
    return grid.sum(1), grid


CASES = [
    ("causal", 24, lambda: layouts.contiguous(24, 4)),
    ("causal", 24, lambda: layouts.headtail(24, 3)),
    ("causal & window(5)", 22, lambda: layouts.headtail(22, 2)),
    ("document(sizes=[6,10,8]) & window(4)", 24, lambda: layouts.per_document([6, 10, 8], 2)),
    ("document(sizes=[5,9,6])", 20, lambda: layouts.per_document([5, 9, 6], 2)),  # each document padded
    ("causal | sink(3)", 21, lambda: layouts.striped(21, 3)),
    ("local(4)", 20, lambda: layouts.striped(20, 2, 3)),
    ("causal & ~window(3)", 16, lambda: layouts.from_indices([[5, 0, 9, 10], [1, 2, 3, 4], [15, 14, 13, 12], [11, 8, 7, 6]], 16, "file")),
]


@pytest.mark.parametrize("expr, length, make", CASES)
def test_cells_and_grid_equal_a_double_loop(expr, length, make):
    layout = make()
    found = work.split(build(expr, length=length), layout)
    cells, grid = reference(expr, length, layout)
    assert found.cells.tolist() == cells.tolist()
    assert found.grid.tolist() == grid.tolist()
    mean = cells.mean()
    assert found.imbalance == pytest.approx(cells.max() / mean)


def test_causal_contiguous_is_imbalanced_and_headtail_balanced():
    # 8 ranks of 128: rank r's rows see 128 r + 1 .. 128 (r + 1) keys; head-tail pairs row blocks r and 15 - r
    mask = build("causal", length=1024)
    cells = np.array([sum(q + 1 for q in range(128 * r, 128 * (r + 1))) for r in range(8)])
    contiguous = work.split(mask, layouts.contiguous(1024, 8))
    assert contiguous.cells.tolist() == cells.tolist()
    assert contiguous.imbalance == pytest.approx(cells.max() / cells.mean())
    assert work.split(mask, layouts.headtail(1024, 8)).imbalance == pytest.approx(1.0)


def test_ring_steps_follow_pytorchs_source_rank_and_name_the_steps_to_skip():
    found = work.split(build("causal", length=16), layouts.contiguous(16, 4))
    steps = found.steps()
    # step i brings rank (r - i) mod N's keys (_is_causal_behavior, _attention.py:96): under causal, contiguous,
    # a rank sees its own block partly and every earlier rank's whole, later ranks' not at all
    for r in range(4):
        for i in range(4):
            s = (r - i) % 4
            assert steps[r, i] == (work.PARTIAL if s == r else work.FULL if s < r else work.EMPTY)


def test_ulysses_work_is_every_cell_for_a_share_of_the_heads():
    mask = build("causal", length=16, heads=6)
    found = work.split(mask, layouts.ulysses(16, 4, 6))
    total = 16 * 17 // 2
    assert found.work().tolist() == [total * h for h in found.layout.heads]
    assert found.grid is None and found.steps() is None
    assert found.flops().tolist() == [4 * 128 * total * h for h in found.layout.heads]


def test_te_cu_seqlens_count_each_ranks_real_tokens_per_document():
    docs = [5, 9, 16]
    layout = layouts.per_document(docs, 2)
    padded, per_rank = work.te_cu_seqlens(layout, np.array(docs))
    assert padded.tolist() == [0, 4, 10, 18]  # padded to 8, 12, 16; divided by cp_size 2
    starts = np.cumsum(docs) - docs
    for r in range(2):
        mine = [p for p in layout.rank_indices(r).tolist() if p >= 0]
        counts = [sum(1 for p in mine if starts[d] <= p < starts[d] + docs[d]) for d in range(3)]
        assert per_rank[r].tolist() == np.concatenate([[0], np.cumsum(counts)]).tolist()


def test_local_cu_seqlens_cut_a_ranks_tokens_where_the_document_changes():
    layout = layouts.contiguous(20, 2)  # rank 0: 0..9, rank 1: 10..19; documents 0..6, 7..14, 15..19
    found = work.local_cu_seqlens(layout, np.array([0, 7, 15]))
    assert [f.tolist() for f in found] == [[0, 7, 10], [0, 5, 10]]
    headtail = layouts.headtail(20, 2)  # rank 0: 0..4 and 15..19; rank 1: 5..14
    assert [f.tolist() for f in work.local_cu_seqlens(headtail, np.array([0, 7, 15]))] == [[0, 5, 10], [0, 2, 10]]


def test_refusals_quote_what_to_change():
    with pytest.raises(MaskError, match="drop --offset"):
        work.split(build("causal", length=4, offset=2), layouts.contiguous(4, 2))
    with pytest.raises(MaskError, match="give --len 8"):
        work.split(build("causal", length=4), layouts.contiguous(8, 2))


EXPRESSIONS = ["causal", "causal & window(3)", "document(sizes=[5,3,8]) & ~window(2)", "full", "local(4) | sink(1)", "causal & ~causal"]


@given(expr=st.sampled_from(EXPRESSIONS), ranks=st.integers(1, 5), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_any_permutation_splits_exactly(expr, ranks, seed):
    # a random permutation as a balancer might write it, sharded into equal parts; the cells and grid from
    # intervals against a double loop over the dense mask (numpy, every cell)
    length = 16
    rng = np.random.default_rng(seed)
    pad = (-length) % ranks
    order = rng.permutation(length + pad)  # indices >= length are padding slots
    layout = layouts.from_indices(list(order.reshape(ranks, -1)), length, "random")
    mask = build(expr, length=length)
    cells = mask.dense()[0, 0]
    owner = {int(p): r for r in range(ranks) for p in order.reshape(ranks, -1)[r] if p < length}
    grid = np.zeros((ranks, ranks), dtype=np.int64)
    for q in range(length):
        for k in range(length):
            grid[owner[q], owner[k]] += bool(cells[q, k])
    found = work.split(mask, layout)
    assert found.grid.tolist() == grid.tolist()
    # the same mask read as a file's cells (a dense tensor) splits the same
    from maskcli.mask import from_tensor

    dense = work.split(from_tensor(cells[None, None], "file"), layout)
    assert dense.grid.tolist() == grid.tolist() and dense.cells.tolist() == found.cells.tolist()


@pytest.mark.parametrize("expr, length, block", [("document(sizes=[100,300,124]) & window(37) | sink(5)", 524, 16),
                                                 ("causal & ~window(20)", 300, 32), ("local(50)", 256, 64)])
def test_touched_blocks_are_create_block_masks_computed_blocks(expr, length, block):
    from torch.nn.attention.flex_attention import create_block_mask

    mask = build(expr, length=length)
    flex = create_block_mask(mask.mask_mod, 1, 1, length, length, device="cpu", BLOCK_SIZE=block)
    computed = (flex.kv_num_blocks + flex.full_kv_num_blocks)[0, 0].tolist()
    assert work.touched_blocks(mask.intervals(), length, block).tolist() == computed
