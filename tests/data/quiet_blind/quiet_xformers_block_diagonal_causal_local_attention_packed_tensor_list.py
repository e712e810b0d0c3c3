# Citation: facebookresearch/xformers xformers/ops/fmha/attn_bias.py @deebdefc97848f2ca5f03b40d161ebb6de1429a7
#   (_materialize_causal_mask with window_size, _SeqLenInfo, BlockDiagonalMask.from_tensor_list / materialize /
#   make_local_attention / split, BlockDiagonalCausalLocalAttentionMask._create_block_mask), used as the class
#   docstring's example does: one linear to q, k, v over the packed tensor, attention with attn_bias, split back.
#   The attention is xformers' reference (tests' ref_attention: q @ k^T * scale + attn_bias.materialize(), softmax),
#   since the fused kernel is CUDA only.
# Masking: three sequences packed on the sequence dimension of a [1, M, H, K] tensor; the bias is -inf off the
#   diagonal blocks and, inside each block, lets query i see keys i - window_size < j <= i of its own sequence.
# Self-check: each split output equals a per-sequence double loop over (i, j) with that window, no packing, no bias;
#   and the backward pass gives no gradient across sequences.
import math
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import torch


def _materialize_causal_mask(shape, dtype=torch.float32, device="cpu", *, window_size=None, from_bottomright=False):
    create_as = dtype if dtype is not torch.bfloat16 else torch.float32
    tensor = torch.full(shape, dtype=create_as, fill_value=1, device=device)
    num_queries, num_keys = shape[-2:]
    shift = 0
    if from_bottomright:
        shift = num_keys - num_queries
    mask = torch.tril(tensor, diagonal=shift).to(dtype)
    if window_size is not None:
        mask = torch.triu(mask, diagonal=shift - window_size + 1)
    mask = torch.log(mask)
    return mask.to(dtype)


@dataclass
class _SeqLenInfo:
    seqstart: torch.Tensor
    max_seqlen: int
    min_seqlen: int
    seqstart_py: List[int]

    def intervals(self) -> Iterable[Tuple[int, int]]:
        yield from zip(self.seqstart_py, self.seqstart_py[1:])

    @classmethod
    def from_seqlens(cls, seqlens: Iterable[int]) -> "_SeqLenInfo":
        seqstart_py = [0]
        max_seqlen = -1
        min_seqlen = -1
        for seqlen in seqlens:
            min_seqlen = min(min_seqlen, seqlen) if min_seqlen != -1 else seqlen
            max_seqlen = max(max_seqlen, seqlen)
            seqstart_py.append(seqstart_py[len(seqstart_py) - 1] + seqlen)
        seqstart = torch.tensor(seqstart_py, dtype=torch.int32)
        return cls(max_seqlen=max_seqlen, min_seqlen=min_seqlen, seqstart=seqstart, seqstart_py=seqstart_py)

    def split(self, x: torch.Tensor, batch_sizes: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
        if self.seqstart_py[-1] != x.shape[1] or x.shape[0] != 1:
            raise ValueError(f"Invalid `torch.Tensor` of shape {x.shape}")
        if batch_sizes is None:
            batch_sizes = [1] * (len(self.seqstart_py) - 1)
        split_chunks = []
        it = 0
        for batch_size in batch_sizes:
            split_chunks.append(self.seqstart_py[it + batch_size] - self.seqstart_py[it])
            it += batch_size
        return [tensor.reshape([bs, -1, *tensor.shape[2:]])
                for bs, tensor in zip(batch_sizes, x.split(split_chunks, dim=1))]


@dataclass
class BlockDiagonalMask:
    q_seqinfo: _SeqLenInfo
    k_seqinfo: _SeqLenInfo
    _batch_sizes: Optional[Sequence[int]] = None

    def _create_block_mask(self, shape, dtype=torch.float32, device="cpu"):
        return torch.zeros(shape, dtype=dtype, device=device)

    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        assert shape[-1] == self.k_seqinfo.seqstart_py[-1]
        assert shape[-2] == self.q_seqinfo.seqstart_py[-1]
        mask = torch.empty(shape[-2:], dtype=dtype, device=device)
        mask.fill_(-math.inf)
        for i, ((q_start, q_end), (k_start, k_end)) in enumerate(
            zip(self.q_seqinfo.intervals(), self.k_seqinfo.intervals())
        ):
            mask[q_start:q_end, k_start:k_end] = self._create_block_mask(
                (q_end - q_start, k_end - k_start), dtype=dtype, device=device)
        for _ in range(len(shape) - 2):
            mask = mask.unsqueeze(0)
        return mask.expand(shape)

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None):
        assert kv_seqlen is None or len(q_seqlen) == len(kv_seqlen)
        q_seqinfo = _SeqLenInfo.from_seqlens(q_seqlen)
        if kv_seqlen is None or q_seqlen == kv_seqlen:
            k_seqinfo = q_seqinfo
        else:
            k_seqinfo = _SeqLenInfo.from_seqlens(kv_seqlen)
        return cls(q_seqinfo=q_seqinfo, k_seqinfo=k_seqinfo)

    @classmethod
    def from_tensor_list(cls, tensors):
        batch_sizes = [tensor.shape[0] for tensor in tensors]
        seqlens = []
        for x in tensors:
            for _ in range(x.shape[0]):
                seqlens.append(x.shape[1])
        block_diag = cls.from_seqlens(seqlens)
        block_diag._batch_sizes = batch_sizes
        tensors_bs1 = tuple(x.reshape([1, -1, *x.shape[2:]]) for x in tensors)
        concat_tensors = torch.cat(tensors_bs1, dim=1)
        return block_diag, concat_tensors

    def split(self, tensor):
        assert self.q_seqinfo is self.k_seqinfo
        return self.q_seqinfo.split(tensor, self._batch_sizes)

    def make_local_attention(self, window_size: int) -> "BlockDiagonalCausalLocalAttentionMask":
        """Experimental: Makes each block causal with local attention"""
        return BlockDiagonalCausalLocalAttentionMask(
            q_seqinfo=self.q_seqinfo, k_seqinfo=self.k_seqinfo, _batch_sizes=self._batch_sizes,
            _window_size=window_size)


@dataclass
class BlockDiagonalCausalMask(BlockDiagonalMask):
    def _create_block_mask(self, shape, dtype=torch.float32, device="cpu"):
        return _materialize_causal_mask(shape, dtype=dtype, device=device)


@dataclass
class BlockDiagonalCausalLocalAttentionMask(BlockDiagonalCausalMask):
    _window_size: int = 0  # forced due to inheritance and default arguments

    def __post_init__(self):
        if self._window_size <= 0:
            raise ValueError(f"Expected `window_size > 0`, but window_size={self._window_size}")
        q_seqlen = [y - x for x, y in zip(self.q_seqinfo.seqstart_py[:-1], self.q_seqinfo.seqstart_py[1:])]
        kv_seqlen = [y - x for x, y in zip(self.k_seqinfo.seqstart_py[:-1], self.k_seqinfo.seqstart_py[1:])]
        for q, k in zip(q_seqlen, kv_seqlen):
            if q - self._window_size >= k:
                raise RuntimeError(
                    f"No keys are attended in q_seqlen {q} k_seqlen {k} with sliding window {self._window_size}")

    def _create_block_mask(self, shape, dtype=torch.float32, device="cpu"):
        return _materialize_causal_mask(shape, dtype=dtype, device=device, window_size=self._window_size)


def ref_attention_bmhk(q, k, v, attn_bias):
    """xformers' reference: [B, M, H, K] in, the bias materialized to [B, H, M, N] and added to the scores."""
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    scale = 1 / q.shape[-1] ** 0.5
    attn = q @ k.transpose(-2, -1) * scale
    attn = attn + attn_bias.materialize(attn.shape, dtype=attn.dtype, device=attn.device)
    attn = attn.softmax(-1)
    return (attn @ v).permute(0, 2, 1, 3)


torch.manual_seed(0)
H, K, WINDOW = 2, 8, 3
list_x = [torch.randn([1, n, H * K], requires_grad=True) for n in (5, 8, 2)]
attn_bias, x = BlockDiagonalMask.from_tensor_list(list_x)
attn_bias = attn_bias.make_local_attention(WINDOW)
linear = torch.nn.Linear(H * K, H * K * 3)

q, k, v = linear(x).reshape([1, -1, H, 3, K]).unbind(-2)
out = ref_attention_bmhk(q, k, v, attn_bias)
list_out = attn_bias.split(out)


def per_sequence_local(xi):
    """One sequence alone: double loop, query t sees keys t - WINDOW < s <= t."""
    qi, ki, vi = linear(xi).reshape([1, -1, H, 3, K]).unbind(-2)
    n = xi.shape[1]
    res = torch.zeros(1, n, H, K)
    for h in range(H):
        for t in range(n):
            keys = [s for s in range(n) if t - WINDOW < s <= t]
            scores = torch.stack([(qi[0, t, h] * ki[0, s, h]).sum() / K ** 0.5 for s in keys])
            w = scores.softmax(0)
            res[0, t, h] = sum(w[j] * vi[0, s, h] for j, s in enumerate(keys))
    return res


for i, xi in enumerate(list_x):
    assert list_out[i].shape == (1, xi.shape[1], H, K)
    ref = per_sequence_local(xi)
    assert torch.allclose(list_out[i], ref, atol=1e-5), (i, (list_out[i] - ref).abs().max())

# a loss on the second sequence's last token reaches only that sequence's last WINDOW tokens
list_out[1][0, -1].sum().backward()
assert list_x[0].grad is None or list_x[0].grad.abs().max() == 0
assert list_x[2].grad is None or list_x[2].grad.abs().max() == 0
g = list_x[1].grad[0].abs().sum(-1)
assert (g[-WINDOW:] > 0).all() and (g[:-WINDOW] == 0).all(), g
print("ok: packed block-diagonal causal local attention matches per-sequence windowed double loop")
