"""A BlockMask of one batch plane serving a call of several batch rows whose mask_mod reads the batch row.

`create_block_mask(mask_mod, B=None, ...)` evaluates the mask_mod at b = 0 only and lists row 0's blocks; the fused
kernel then visits those blocks for every row of the batch, asking the mask_mod per row only inside them. Where the
program's own mask_mod, asked at another row's b, keeps a cell in a key block the lists never visit, that row loses
keys its own mask_mod states (axonn-ai/yalis#53: a decode BlockMask built with B=None from `kv_idx <= token_counter[b]`,
so the long sequence saw only the short one's blocks). The unfused CPU path evaluates the mask_mod on every cell and
hides it; the blocks are what a GPU run attends. Read only where row 0's own mask_mod keeps nothing outside the listed
blocks (the lists are the mask_mod's, not a sparsity the program chose), heads at plane 0, at most ROWS rows and CELLS
cells evaluated. checks/flexrows.py says it.
"""

from __future__ import annotations

import numpy as np

ROWS = 8
CELLS = 1 << 22


def _unlisted(block_mask, i: int, k_blocks: int) -> np.ndarray:
    """Key block indices of query block i that plane (0, 0) lists neither partial nor full."""
    listed = set()
    for n, idx in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                   (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        if n is None or i >= n.shape[2]:
            continue
        count = int(n[0, 0, i])
        listed.update(int(x) for x in idx[0, 0, i, :count].tolist())
    return np.array([j for j in range(k_blocks) if j not in listed], dtype=np.int64)


_LAST: list = [None, None, None]  # the last BlockMask read (held, so that its id is not reused), its key, its answer


def unvisited(block_mask, batch: int, q_len: int, k_len: int, evaluate) -> dict | None:
    """{"row", "query", "key", "cells", "keys"} of the first batch row >= 1 whose mask_mod keeps cells in key blocks the
    one plane's lists never visit (a (q, k) cell, how many such cells, the key range); None where none does.
    `evaluate`: trace/flex.py's reading of a mask_mod on (rows, cols). The answer for one BlockMask is kept: every
    layer of a model call is handed the same one."""
    if block_mask is None or batch < 2 or int(block_mask.kv_num_blocks.shape[0]) != 1:
        return None
    key = (batch, q_len, k_len)
    if _LAST[0] is block_mask and _LAST[1] == key:
        return _LAST[2]
    found = _unvisited(block_mask, batch, q_len, k_len, evaluate)
    _LAST[:] = [block_mask, key, found]
    return found


def _unvisited(block_mask, batch: int, q_len: int, k_len: int, _evaluate) -> dict | None:
    q_block, kv_block = (int(x) for x in block_mask.BLOCK_SIZE)
    k_blocks = -(-k_len // kv_block)
    device = block_mask.kv_indices.device
    bands = []
    for i in range(-(-q_len // q_block)):
        blocks = _unlisted(block_mask, i, k_blocks)
        if len(blocks):
            cols = np.concatenate([np.arange(j * kv_block, min(k_len, (j + 1) * kv_block)) for j in blocks.tolist()])
            bands.append((np.arange(i * q_block, min(q_len, (i + 1) * q_block)), cols))
    if not bands or sum(len(r) * len(c) for r, c in bands) * min(batch, ROWS + 1) > CELLS:
        return None
    if any(_evaluate(block_mask.mask_mod, 0, 0, r, c, device).any() for r, c in bands):
        return None  # (row 0 keeps cells its own lists skip: the blocks are the program's own sparsity)
    for b in range(1, min(batch, ROWS + 1)):
        found = [(r, c, cells) for r, c in bands if (cells := _evaluate(block_mask.mask_mod, b, 0, r, c, device)).any()]
        if found:
            r, c, cells = found[0]
            q, k = np.argwhere(cells)[0]
            keys = np.concatenate([c[cells.any(axis=0)] for _, c, cells in found])
            return {"row": b, "query": int(r[q]), "key": int(c[k]), "cells": int(sum(x.sum() for _, _, x in found)),
                    "keys": [int(keys.min()), int(keys.max()) + 1]}
    return None
