"""Block views from intervals equal FlexAttention's create_block_mask, for random expressions and block sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import definitions as ref
from maskcli.blockmask import EMPTY, FULL, PARTIAL, layout
from maskcli.mask import MaskOptions, build, from_tensor
from strategies import cases

NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def assert_same_as_flex(mask, q_block, kv_block):
    f = mask.frame
    flex = create_block_mask(mask.mask_mod, mask.batch, mask.heads, f.q_len, f.k_len, device="cpu", BLOCK_SIZE=(q_block, kv_block))
    ours = layout(mask, q_block, kv_block)
    arrays = ours.arrays()
    for name in NAMES:
        assert np.array_equal(arrays[name], getattr(flex, name).numpy()), name
        assert arrays[name].dtype == np.int32
    assert ours.sparsity() == pytest.approx(flex.sparsity(), abs=1e-9)
    dense = flex.to_dense().numpy()  # 1 for partial and full blocks
    for b in range(mask.batch):
        categories = ours.categories(b)
        assert np.array_equal(categories != EMPTY, dense[b, 0].astype(bool))
    return ours


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases(), q_block=st.sampled_from([1, 2, 3, 4, 7, 16]), kv_block=st.sampled_from([1, 2, 3, 5, 16]))
def test_random_expressions_equal_create_block_mask(case, q_block, kv_block):
    tree, options, frame, valid = case
    assert_same_as_flex(build(ref.text(tree), MaskOptions(**options)), q_block, kv_block)


@pytest.mark.parametrize("text, options", [
    ("document(sizes=[700,900,450]) & window(300)", {}),
    ("causal & (window(500) | sink(4))", {"length": 2000}),
    ("causal | blocks(" + ",".join(["-1"] * 300 + ["0"] * 400 + ["-1"] * 500 + ["1"] * 300) + ")", {}),
    ("local(512)", {"length": 1500, "ids": ";".join([",".join(["0"] * 37 + ["5"] * 1463), ",".join(["5"] * 1500)])}),
    ("window(256)", {"offset": 1000, "length": 777, "kv_start": 600}),
    ("tril(-3)", {"length": 1000, "kv_len": 1300}),
])
@pytest.mark.parametrize("block", [16, 64, 128, (128, 64)])
def test_masks_of_a_few_thousand_tokens_equal_create_block_mask(text, options, block):
    q_block, kv_block = (block, block) if isinstance(block, int) else block
    assert_same_as_flex(build(text, **options), q_block, kv_block)


def test_labels_that_go_down_and_tensors_are_counted_cell_by_cell_and_still_equal():
    down = build("chunk(" + ",".join(str(v) for v in [0, 2, 1, 3] * 50) + ")")
    assert not down.exact
    assert_same_as_flex(down, 16, 16)
    keep = np.tril(np.ones((2, 3, 40, 40), dtype=bool))
    keep[1, 2, :, :5] = False  # heads and batch rows that differ
    tensor = from_tensor(keep, "file.pt")
    ours = layout(tensor, 8, 8)
    flex = create_block_mask(tensor.mask_mod, 2, 3, 40, 40, device="cpu", BLOCK_SIZE=8)
    for name in NAMES:
        assert np.array_equal(ours.arrays()[name], getattr(flex, name).numpy()), name


def test_counts_are_the_three_kinds_of_block():
    blocks = layout(build("causal", length=1024), 128, 128)
    assert blocks.counts(0) == (28, 8, 28)
    categories = blocks.categories(0)
    assert (np.diag(categories) == PARTIAL).all() and categories[5, 2] == FULL and categories[2, 5] == EMPTY
    assert blocks.sparsity() == pytest.approx(100 * 28 / 64)


def test_saved_tensors_rebuild_the_block_mask():
    built = build("document(sizes=[100,60,40]) & window(32)")
    blocks = layout(built, 16, 16)
    data = {name: torch.from_numpy(value.copy()) for name, value in blocks.arrays().items()}
    rebuilt = BlockMask.from_kv_blocks(**data, BLOCK_SIZE=(16, 16), seq_lengths=(200, 200))
    flex = create_block_mask(built.mask_mod, 1, 1, 200, 200, device="cpu", BLOCK_SIZE=16)
    assert torch.equal(rebuilt.to_dense(), flex.to_dense())
    assert torch.equal(rebuilt.q_indices, flex.q_indices) and torch.equal(rebuilt.full_q_num_blocks, flex.full_q_num_blocks)


def test_a_million_tokens_in_blocks_of_128():
    blocks = layout(build("window(4096)", length=1 << 20), 128, 128)
    n = 8192
    assert blocks.n_q == blocks.n_kv == n
    # closed form: each query block sees its own block and the 32 before it, of which 31 whole and 2 cut by the window
    full, partial, empty = blocks.counts(0)
    assert partial == n + (n - 32)  # the diagonal block, and the block 32 back where the window ends mid-block
    assert full == sum(min(i, 31) for i in range(n))
    assert full + partial + empty == n * n


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases(), q_block=st.sampled_from([1, 2, 3, 16]), kv_block=st.sampled_from([1, 2, 5, 16]))
def test_counts_alone_equal_create_block_mask(case, q_block, kv_block):
    """layout(..., indices=False) (blocks --summary) makes no index arrays, and its counts are create_block_mask's."""
    tree, options, frame, valid = case
    mask = build(ref.text(tree), MaskOptions(**options))
    f = mask.frame
    flex = create_block_mask(mask.mask_mod, mask.batch, mask.heads, f.q_len, f.k_len, device="cpu", BLOCK_SIZE=(q_block, kv_block))
    ours = layout(mask, q_block, kv_block, indices=False)
    assert ours.kv_indices is None and ours.full_kv_indices is None
    assert (ours.n_q, ours.n_kv) == tuple(flex.kv_indices.shape[-2:])
    for b in range(mask.batch):
        assert ours.counts(b) == (int(flex.full_kv_num_blocks[b, 0].sum()), int(flex.kv_num_blocks[b, 0].sum()),
                                  ours.n_q * ours.n_kv - int(flex.full_kv_num_blocks[b, 0].sum()) - int(flex.kv_num_blocks[b, 0].sum()))
    assert ours.sparsity() == pytest.approx(flex.sparsity(), abs=1e-9)


def test_the_counts_of_4m_causal_tokens_need_no_block_map():
    """causal at 4,194,304 tokens: 32,768 x 32,768 blocks of 128, counted from the intervals (the index arrays alone
    would be 8 GB): n(n-1)/2 full blocks below the diagonal, n partial on it."""
    n = 4_194_304 // 128
    ours = layout(build("causal", MaskOptions(length=4_194_304)), indices=False)
    assert ours.counts(0) == (n * (n - 1) // 2, n, n * n - n * (n - 1) // 2 - n)


def test_counts_alone_of_a_mask_counted_block_by_block_make_no_indices():
    """A mask counted block by block (chunk labels that fall, [1, 0]: no intervals) makes no index arrays where only
    its counts are asked for (hypothesis found the block-by-block path building them anyway), and its counts are
    create_block_mask's."""
    mask = build("chunk(1,0)", MaskOptions(length=2))
    flex = create_block_mask(mask.mask_mod, mask.batch, mask.heads, 2, 2, device="cpu", BLOCK_SIZE=(1, 1))
    ours = layout(mask, 1, 1, indices=False)
    assert ours.kv_indices is None and ours.full_kv_indices is None
    assert ours.kv_num_blocks.tolist() == flex.kv_num_blocks.tolist()
    assert ours.full_kv_num_blocks.tolist() == flex.full_kv_num_blocks.tolist()
