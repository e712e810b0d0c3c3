"""FlexAttention's block view of a mask, exactly as create_block_mask makes it, without its dense mask.

create_block_mask evaluates the mask_mod on every cell, pads the sequence with hidden
cells to whole blocks, and calls a block full when all its cells are visible and partial
when some are. Here the same blocks come from the key intervals (O(rows + blocks)), so
the four tensors of a BlockMask can be had at lengths where the eager call runs out of
memory:

    kv_num_blocks, kv_indices            partial blocks per query block, their indices first
    full_kv_num_blocks, full_kv_indices  the same for full blocks

Index rows hold the chosen blocks ascending, then every other block ascending, as
FlexAttention's stable argsort leaves them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maskcli.counting import block_counts
from maskcli.intervals import ordered
from maskcli.mask import Mask
from maskcli.memory import check_dense_fits

DEFAULT_BLOCK = 128  # FlexAttention's _DEFAULT_SPARSE_BLOCK_SIZE
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True, eq=False)
class Blocks:
    """The block view of a mask; arrays are (B, H', n_q[, n_kv]), H' = 1 where every head is the same."""

    mask: Mask
    q_block: int
    kv_block: int
    kv_num_blocks: np.ndarray
    kv_indices: np.ndarray | None  # None where only the counts were asked for (layout(..., indices=False))
    full_kv_num_blocks: np.ndarray
    full_kv_indices: np.ndarray | None
    sets: tuple | None = None  # (touched, full) block intervals per batch row, where the mask's intervals are few

    @property
    def n_q(self) -> int:
        return self.kv_num_blocks.shape[-1]

    @property
    def n_kv(self) -> int:
        return -(-self.mask.frame.k_len // self.kv_block)

    def counts(self, b: int, h: int = 0) -> tuple[int, int, int]:
        """(full, partial, empty) blocks of batch row b, head h."""
        h = h if self.kv_num_blocks.shape[1] > 1 else 0
        full = int(self.full_kv_num_blocks[b, h].sum())
        partial = int(self.kv_num_blocks[b, h].sum())
        return full, partial, self.n_q * self.n_kv - full - partial

    def sparsity(self) -> float:
        """BlockMask.sparsity(): the percentage of the (B, H, Lq, Lk) cells in blocks not computed."""
        batch, heads, q_len, k_len = self.mask.shape
        computed = (int(self.kv_num_blocks.sum()) + int(self.full_kv_num_blocks.sum())) * (heads // self.kv_num_blocks.shape[1])
        return 100 * (1 - computed * self.q_block * self.kv_block / (batch * heads * q_len * k_len))

    def categories(self, b: int, h: int = 0) -> np.ndarray:
        """int8 (n_q, n_kv): EMPTY, PARTIAL or FULL per block."""
        h = h if self.kv_num_blocks.shape[1] > 1 else 0
        if self.sets is not None:
            touched, full = self.sets
            out = touched.dense(b, 0, self.n_q).view(np.int8)  # 1 where touched: PARTIAL unless full
            out += full.dense(b, 0, self.n_q).view(np.int8)
            return out
        out = np.zeros((self.n_q, self.n_kv), dtype=np.int8)
        rows = np.arange(self.n_q)[:, None]
        for value, num, indices in ((PARTIAL, self.kv_num_blocks, self.kv_indices), (FULL, self.full_kv_num_blocks, self.full_kv_indices)):
            chosen = np.arange(self.n_kv)[None, :] < num[b, h][:, None]  # the first num indices of each row
            out[np.broadcast_to(rows, chosen.shape)[chosen], indices[b, h][chosen]] = value
        return out

    def block_mask_arrays(self) -> dict[str, np.ndarray]:
        """All eight BlockMask tensors at the mask's (B, H): the kv side, and the q side that the backward pass
        reads, so that BlockMask(**these, ...) needs no transposing (from_kv_blocks took minutes at 1M tokens
        making them). One plane serves every batch row and head where the stored arrays are one plane."""
        batch, heads = self.mask.shape[:2]
        out = self.arrays()
        for prefix, num, indices in (("", self.kv_num_blocks, self.kv_indices), ("full_", self.full_kv_num_blocks, self.full_kv_indices)):
            planes = (1, 1) if _one_plane(num) else num.shape[:2]
            q_num, q_indices = transposed(
                np.ascontiguousarray(num[: planes[0], : planes[1]]).reshape(-1, self.n_q),
                np.ascontiguousarray(indices[: planes[0], : planes[1]]).reshape(-1, self.n_q, self.n_kv), self.n_q, self.n_kv,
            )
            out[f"{prefix}q_num_blocks"] = np.broadcast_to(q_num.reshape(planes + (self.n_kv,)), (batch, heads, self.n_kv))
            out[f"{prefix}q_indices"] = np.broadcast_to(q_indices.reshape(planes + (self.n_kv, self.n_q)), (batch, heads, self.n_kv, self.n_q))
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        """The four BlockMask arrays at the mask's full (B, H), as create_block_mask(mask_mod, B, H, ...) gives them."""
        batch, heads = self.mask.shape[:2]
        return {
            name: np.broadcast_to(value, (batch, heads) + value.shape[2:])
            for name, value in (
                ("kv_num_blocks", self.kv_num_blocks), ("kv_indices", self.kv_indices),
                ("full_kv_num_blocks", self.full_kv_num_blocks), ("full_kv_indices", self.full_kv_indices),
            )
        }


def _one_plane(array: np.ndarray) -> bool:
    """Every stored (batch row, head) plane is one and the same: one head, and one batch row or a broadcast view of one."""
    return array.shape[1] == 1 and (array.shape[0] == 1 or array.strides[0] == 0)


def transposed(num: np.ndarray, indices: np.ndarray, n_q: int, n_kv: int) -> tuple[np.ndarray, np.ndarray]:
    """The q side of one block kind, as BlockMask keeps it for the backward pass: per key block, how many query
    blocks hold it and which (those first, ascending, then the rest), as FlexAttention's _transpose_ordered gives
    them. `num` (P, n_q) and `indices` (P, n_q, n_kv) over the stored planes; int32 out, (P, n_kv) and (P, n_kv, n_q)."""
    planes = num.shape[0]
    q_num = np.empty((planes, n_kv), dtype=np.int32)
    q_indices = np.empty((planes, n_kv, n_q), dtype=np.int32)
    for p in range(planes):  # a few planes (batch rows x distinct heads); each one vectorised
        dense = np.zeros((n_kv, n_q), dtype=bool)  # transposed: one row per key block
        chosen = np.arange(n_kv)[None, :] < num[p][:, None]
        rows = np.broadcast_to(np.arange(n_q)[:, None], chosen.shape)[chosen]
        dense[indices[p][chosen], rows] = True
        q_num[p] = dense.sum(1)
        q_indices[p] = np.argsort(~dense, axis=1, kind="stable")
    return q_num, q_indices


def layout(mask: Mask, q_block: int = DEFAULT_BLOCK, kv_block: int = DEFAULT_BLOCK, progress=None,
           indices: bool = True) -> Blocks:
    """The blocks of `mask`: from its intervals where they are few, else from exact counts per block. `indices`: False
    where only the counts are read (blocks --summary): a mask with intervals then makes no (n_q, n_kv) array, so the
    counts of 4M tokens (32,768 x 32,768 blocks) take O(rows), not 8 GB of indices."""
    f = mask.frame
    n_q, n_kv = -(-f.q_len // q_block), -(-f.k_len // kv_block)
    heads = mask.heads if mask.heads_differ else 1  # a file's own heads, a mask_mod that reads h
    if indices or not mask.exact:  # (counted block by block: (n_q, n_kv) counts a plane)
        check_dense_fits((mask.batch, heads, n_q, n_kv), 4 * 2 + 2, "for the block indices", what="a block mask of",
                         fix="use a larger --block, or a shorter mask")
    if mask.exact:  # every batch row at once (heads are one: a mask with intervals has no per-head tensor)
        touched, full = mask.intervals().block_sets(f.q_len, q_block, kv_block)
        partial = touched & ~full
        planes = (touched.starts.shape[0], 1, n_q)
        arrays = {"kv_num_blocks": partial.counts().reshape(planes), "full_kv_num_blocks": full.counts().reshape(planes)}
        if indices:
            arrays["kv_indices"] = ordered(partial, n_kv).reshape(planes + (n_kv,))
            arrays["full_kv_indices"] = ordered(full, n_kv).reshape(planes + (n_kv,))
        # one stored row serves every batch row: a broadcast view, as a mask of one plane stays a view
        stacked = {name: np.broadcast_to(value.astype(np.int32, copy=False), (mask.batch,) + value.shape[1:]) for name, value in arrays.items()}
        stacked.setdefault("kv_indices", None)
        stacked.setdefault("full_kv_indices", None)
        return Blocks(mask, q_block, kv_block, **stacked, sets=(touched, full))
    parts: dict[str, list] = {"kv_num_blocks": [], "kv_indices": [], "full_kv_num_blocks": [], "full_kv_indices": []}
    for b in range(mask.batch):
        for h in range(heads):
            counts = block_counts(mask, b, h, q_block, kv_block, progress)
            is_full = counts == q_block * kv_block  # a block cut short by the end is padded with hidden cells
            is_partial = (counts > 0) & ~is_full
            rows = {"kv_num_blocks": is_partial.sum(1), "full_kv_num_blocks": is_full.sum(1)}
            if indices:  # (blocks --summary reads the counts alone: no index arrays, whichever path counted them)
                rows.update(kv_indices=np.argsort(~is_partial, axis=1, kind="stable"),
                            full_kv_indices=np.argsort(~is_full, axis=1, kind="stable"))
            for name, value in rows.items():
                parts[name].append(np.asarray(value, dtype=np.int32))
    parts = {name: values for name, values in parts.items() if values}
    if mask.batch * heads == 1:  # one (batch, head): a view, not a copy of the largest arrays
        stacked = {name: values[0][None, None] for name, values in parts.items()}
    else:
        stacked = {name: np.stack(values).reshape((mask.batch, heads) + values[0].shape) for name, values in parts.items()}
    stacked.setdefault("kv_indices", None)
    stacked.setdefault("full_kv_indices", None)
    return Blocks(mask, q_block, kv_block, **stacked)
