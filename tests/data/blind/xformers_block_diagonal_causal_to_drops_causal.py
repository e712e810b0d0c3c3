"""xformers BlockDiagonalCausalMask.to() returned a non-causal BlockDiagonalMask.

Citation: facebookresearch/xformers#1185 ("Incorrect implementation of
`BlockDiagonalCausalMask.to(..)`"), fixed by commit a8746f3bb3bab42aa6064b5e4ee9ba80ce0a2bcf
(xformers 0.0.28.post3 was the reported version).

Bug: `BlockDiagonalCausalMask` inherited `BlockDiagonalMask.to(device)`, which rebuilt a
plain `BlockDiagonalMask(...)` from the moved seqinfo.  Any caller that moved the bias to
the query's device (the usual `attn_bias.to(q.device)`) silently lost the causal part: each
packed sequence attended to its own future tokens.
Fix: `to()` builds `self.__class__(...)` (type(self)), so the causal subclass survives.

Reproduction: a small port of the attn_bias classes (seqinfo from `from_seqlens`,
`materialize`), a packed batch of two sequences [3, 4] through a memory-efficient-attention
reference (softmax over q @ k^T + bias), exactly as the issue's repro: build with
`from_seqlens`, move with `.to(device)`, then attend.  Only the `.to()` line differs.
The upstream thread (issue + maintainer's fix link) was read; the fix commit's diff was not.
"""
import sys
from dataclasses import dataclass

import torch

FIXED = "--fixed" in sys.argv


@dataclass
class _SeqLenInfo:
    seqstart: torch.Tensor
    max_seqlen: int
    seqstart_py: list

    @classmethod
    def from_seqlens(cls, seqlens):
        seqstart_py = [0]
        for s in seqlens:
            seqstart_py.append(seqstart_py[-1] + s)
        return cls(torch.tensor(seqstart_py, dtype=torch.int32), max(seqlens), seqstart_py)

    def to(self, device):
        return _SeqLenInfo(self.seqstart.to(device), self.max_seqlen, self.seqstart_py)

    def intervals(self):
        return zip(self.seqstart_py, self.seqstart_py[1:])


class BlockDiagonalMask:
    """Packed sequences: query block i attends only to key block i."""

    def __init__(self, q_seqinfo, k_seqinfo):
        self.q_seqinfo = q_seqinfo
        self.k_seqinfo = k_seqinfo

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None):
        q = _SeqLenInfo.from_seqlens(q_seqlen)
        k = q if kv_seqlen is None else _SeqLenInfo.from_seqlens(kv_seqlen)
        return cls(q_seqinfo=q, k_seqinfo=k)

    def to(self, device):
        if FIXED:
            cls = type(self)
        else:
            cls = BlockDiagonalMask
        return cls(q_seqinfo=self.q_seqinfo.to(device), k_seqinfo=self.k_seqinfo.to(device))

    def _create_block_mask(self, shape, dtype):
        return torch.zeros(shape, dtype=dtype)

    def materialize(self, shape, dtype=torch.float32):
        mask = torch.full(shape[-2:], float("-inf"), dtype=dtype)
        for (q_start, q_end), (k_start, k_end) in zip(self.q_seqinfo.intervals(), self.k_seqinfo.intervals()):
            mask[q_start:q_end, k_start:k_end] = self._create_block_mask((q_end - q_start, k_end - k_start), dtype)
        return mask.expand(shape)


class BlockDiagonalCausalMask(BlockDiagonalMask):
    """Same as BlockDiagonalMask, plus a causal (upper-left) mask inside each block."""

    def _create_block_mask(self, shape, dtype):
        return torch.triu(torch.full(shape, float("-inf"), dtype=dtype), diagonal=1)


def memory_efficient_attention(query, key, value, attn_bias=None):
    """Reference of xformers.ops.memory_efficient_attention, layout [B, M, H, K]."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if attn_bias is not None:
        scores = scores + attn_bias.materialize(scores.shape, dtype=scores.dtype)
    return (scores.softmax(-1) @ v).transpose(1, 2)


def main():
    torch.manual_seed(0)
    seqlens = [3, 4]
    heads, head_dim = 2, 8
    total = sum(seqlens)
    q, k, v = (torch.randn(1, total, heads, head_dim) for _ in range(3))
    device = q.device
    attn_bias = BlockDiagonalCausalMask.from_seqlens(seqlens).to(device)
    out = memory_efficient_attention(q, k, v, attn_bias=attn_bias)
    print(type(attn_bias).__name__, "out[0,0,0,:3] =", [round(x, 4) for x in out[0, 0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
