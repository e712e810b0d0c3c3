"""trace/flexrows.py: cells a later batch row's mask_mod keeps in key blocks a one-plane BlockMask never lists."""

from __future__ import annotations

import pytest
import torch

flex = pytest.importorskip("torch.nn.attention.flex_attention")

from maskcli.trace.flex import _evaluate  # noqa: E402
from maskcli.trace.flexrows import unvisited as _unvisited  # noqa: E402


def unvisited(*args):
    return _unvisited(*args, _evaluate)


def _reference(mask_mod, block_mask, batch, q_len, k_len):
    """(row, cells) of the first row >= 1 whose mask_mod keeps a cell outside row 0's listed blocks, by a double loop."""
    dense = block_mask.to_dense()[0, 0]  # (q blocks, k blocks): 1 where row 0's lists hold the block
    q_block, k_block = block_mask.BLOCK_SIZE
    for b in range(1, batch):
        cells = [(q, k) for q in range(q_len) for k in range(k_len)
                 if not dense[q // q_block, k // k_block] and bool(mask_mod(torch.tensor(b), 0, torch.tensor(q), torch.tensor(k)))]
        if cells:
            return b, cells
    return None


def test_decode_lengths_per_row():
    counter = torch.tensor([5, 200, 300])

    def mod(b, h, q, kv):
        return kv <= counter[b]

    mask = flex.create_block_mask(mod, B=None, H=None, Q_LEN=1, KV_LEN=384, device="cpu")
    found = unvisited(mask, 3, 1, 384)
    row, cells = _reference(mod, mask, 3, 1, 384)
    assert found["row"] == row and found["cells"] == len(cells) and (found["query"], found["key"]) == cells[0]
    assert found["keys"] == [min(k for _, k in cells), max(k for _, k in cells) + 1]


def test_quiet_with_a_plane_per_row_or_a_mask_mod_that_ignores_b():
    counter = torch.tensor([5, 200])

    def by_row(b, h, q, kv):
        return kv <= counter[b]

    def causal(b, h, q, kv):
        return kv <= q

    assert unvisited(flex.create_block_mask(by_row, B=2, H=None, Q_LEN=1, KV_LEN=384, device="cpu"), 2, 1, 384) is None
    assert unvisited(flex.create_block_mask(causal, B=None, H=None, Q_LEN=256, KV_LEN=256, device="cpu"), 2, 256, 256) is None
    assert unvisited(flex.create_block_mask(by_row, B=None, H=None, Q_LEN=1, KV_LEN=384, device="cpu"), 1, 1, 384) is None
