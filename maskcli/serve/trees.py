"""Speculative draft trees as engines pack them: the tree a custom mask holds, and where it is not one.

A verify step's request has `q_len` draft nodes after `prefix` cached tokens; its custom mask
is (q_len, prefix + q_len), True = attend. A tree mask sees the whole prefix, and among the
drafts exactly the node's ancestors and itself. The parent of node i is read as its deepest
ancestor: of the earlier drafts it sees, the one with the longest line inside its own. Layouts: FlashInfer's and SGLang's flattened bool
(or FlashInfer's bytes, bit i of byte n = element 8n+i), TensorRT-LLM's int32 words per node
(bit j of word j // 32 = the node sees draft j).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maskcli.errors import MaskError


@dataclass(frozen=True)
class Tree:
    parents: np.ndarray  # int64 (n,), -1 for a root
    prefix: int
    wrong: tuple[int, int, bool] | None  # first cell (node, key, what the mask holds) off the tree's mask

    @property
    def depth(self) -> np.ndarray:
        depth = np.zeros(len(self.parents), np.int64)
        for i, parent in enumerate(self.parents.tolist()):  # drafts are a few hundred at most
            depth[i] = depth[parent] + 1 if parent >= 0 else 0
        return depth


def read_tree(cells: np.ndarray, parents: np.ndarray | None = None, hidden: int = 0) -> Tree:
    """The tree a (q_len, prefix + q_len) custom mask holds, and its first cell off that tree's mask; with
    `parents` (a choice list's tree, as many nodes), the first cell off that tree's mask instead. `hidden`: keys
    before the cells, all seen and not stored (ServeBatch.tree_prefix)."""
    from maskcli.kinds.tree import ancestor_table

    n, keys = cells.shape
    stored = keys - n
    drafts = cells[:, stored:]
    parents = _parents(drafts) if parents is None else parents
    expected = np.concatenate([np.ones((n, stored), bool), ancestor_table(parents)], 1)
    off = np.argwhere(expected != cells)
    wrong = None if not off.size else (int(off[0, 0]), int(off[0, 1]) + hidden, bool(cells[off[0, 0], off[0, 1]]))
    return Tree(parents, stored + hidden, wrong)


def _parents(drafts: np.ndarray) -> np.ndarray:
    """Each node's parent: of the earlier drafts it sees whose own line lies inside its line, the deepest (the
    first such on a tie, as trees are laid out breadth first), -1 where it sees none."""
    n = len(drafts)
    d = drafts.astype(np.int32)
    outside = d @ (1 - d).T  # [j, i]: drafts j sees that i does not
    index = np.arange(n)
    candidate = (np.tril(drafts, -1) & (outside.T == 0))
    score = np.where(candidate, d.sum(1)[None, :] * (n + 1) + (n - index)[None, :], -1)
    return np.where(candidate.any(1), np.argmax(score, 1), -1).astype(np.int64)


def unpack_bytes(packed: np.ndarray, indptr: np.ndarray, sizes: np.ndarray, where: str) -> list[np.ndarray]:
    """FlashInfer's packed custom mask: per request `sizes[r]` bits from byte indptr[r], little-endian."""
    _in_range(packed, -128 if packed.dtype == np.int8 else 0, 255, where, "bytes (uint8)")  # astype(uint8) wraps 999 to 231
    out = []
    for r, size in enumerate(sizes.tolist()):
        segment = packed[indptr[r]:indptr[r + 1]].astype(np.uint8)
        if segment.size * 8 < size:
            raise MaskError(f"{where}: request {r} has {segment.size} bytes for {size} mask bits; each request's "
                            f"(qo_len x kv_len) bits are packed into ceil(bits / 8) bytes")
        out.append(np.unpackbits(segment, bitorder="little")[:size].astype(bool))
    return out


def _in_range(values: np.ndarray, low: int, high: int, where: str, what: str) -> None:
    """Refuse values that the engine's storage type cannot hold: cast to it, they would wrap into other bits."""
    if values.size and (int(values.min()) < low or int(values.max()) > high):
        bad = int(values.min()) if int(values.min()) < low else int(values.max())
        raise MaskError(f"{where} holds {bad}, outside {low:,} to {high:,}: its values are {what}; "
                        f"save the mask as the engine packs it")


def unpack_words(words: np.ndarray, nodes: int, where: str = "spec_decoding_packed_mask") -> np.ndarray:
    """TensorRT-LLM's spec_decoding_packed_mask row block (nodes, words) int32 -> bool (nodes, nodes)."""
    _in_range(words[:nodes], -2**31, 2**32 - 1, where, "32-bit words (int32, or their unsigned reading)")  # <i4 wraps 2^33
    as_bytes = np.ascontiguousarray(words[:nodes].astype("<i4")).view(np.uint8).reshape(nodes, -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :nodes].astype(bool)
