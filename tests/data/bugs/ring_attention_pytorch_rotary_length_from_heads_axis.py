# Citation: lucidrains/ring-attention-pytorch#15 ("Question about RoPE"), fixed by
#   lucidrains/ring-attention-pytorch commit ea485d0 ("address an issue with rotary").
# Upstream: ring_attention_pytorch/ring_attention.py at ea485d0^ (RingRotaryEmbedding,
#   apply_rotary_pos_emb, default_attention, RingAttention.forward).
# Bug: RingAttention lays q, k, v out as (b, n, h, d) but asked its own rotary embedding for
#   `q.shape[-2]` positions, i.e. the number of heads, not the sequence length.  With a single
#   head the (1, 1, d) table broadcasts over every token: each query and key is rotated by
#   position 0, so the causal layer runs with no positions at all.
# Fix: `rotary_emb = self.rotary_embed(q.shape[-3])`, the sequence axis.
#
# Port notes: one process, no torch.distributed (ring_attn=False, so the rotary table is the
# plain arange branch); einops' rearrange / repeat written with view / repeat_interleave;
# beartype and autocast decorators dropped; the layer runs with force_regular_attn=True
# (upstream's default_attention), the CPU path the test suite also uses for comparisons.

import sys
from typing import Tuple

import torch
from torch import nn, einsum, Tensor
import torch.nn.functional as F
from torch.nn import Module

FIXED = "--fixed" in sys.argv

# helper functions

def exists(v):
    return v is not None

def default(v, d):
    return v if exists(v) else d

def divisible_by(num, den):
    return (num % den) == 0

def is_distributed():
    return False

def get_rank():
    return 0

def get_world_size():
    return 1

def softclamp(t, value):
    return (t / value).tan() * value

def default_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    causal: bool = False,
    softclamp_qk_sim: bool = False,
    softclamp_value: float = 30.
):
    device = q.device
    q = q * (q.shape[-1] ** -0.5)

    mask_value = -torch.finfo(q.dtype).max

    # account for grouped query attention

    heads, kv_heads = q.shape[-2], k.shape[-2]
    assert divisible_by(heads, kv_heads)
    q_head_groups = heads // kv_heads

    # repeat(t, '... h d -> ... (g h) d', g = q_head_groups)
    k, v = map(lambda t: t.repeat(1, 1, q_head_groups, 1), (k, v))

    # similarity

    sim = einsum('b i h d, b j h d -> b h i j', q, k)

    # softclamp

    if softclamp_qk_sim:
        sim = softclamp(sim, softclamp_value)

    # masking

    if causal:
        i, j = sim.shape[-2:]
        causal_mask = torch.ones((i, j), dtype = torch.bool, device = device).triu(j - i + 1)
        sim = torch.where(causal_mask, mask_value, sim)

    elif exists(mask):
        mask = mask[:, None, None, :]
        sim = sim.masked_fill(~mask, mask_value)

    # attend

    attn = sim.softmax(dim = -1)

    # aggregate

    out = einsum('b h i j, b j h d -> b i h d', attn, v)

    return out

# rotary embeddings with modifications to support striped attention

class RingRotaryEmbedding(Module):
    def __init__(
        self,
        dim,
        ring: bool = False,
        striped: bool = False,
        buckets: int = 1,
        theta = 10000
    ):
        super().__init__()
        self.ring = ring
        self.striped = striped
        self.buckets = buckets

        inv_freq = theta ** -(torch.arange(0, dim, 2).float() / dim)
        self.register_buffer('inv_freq', inv_freq)

    @property
    def device(self):
        return self.inv_freq.device

    @property
    def is_cuda(self):
        return self.inv_freq.is_cuda

    def forward(
        self,
        seq_len: int
    ):
        device = self.device

        pos = None

        if self.ring:
            if self.striped:
                buckets = 1 if self.is_cuda else self.buckets
                ring_stride = get_world_size() * buckets

                pos = torch.arange(seq_len // buckets, device = device)
                pos = pos[:, None].repeat(1, buckets)

                pos = pos * ring_stride
                pos += torch.arange(buckets, device = device) + (get_rank() * buckets)
                pos = pos.t().reshape(-1)

            else:
                pos = torch.arange(seq_len, device = device)
                pos += seq_len * get_rank()
        else:
            pos = torch.arange(seq_len, device = device)

        pos = pos.type_as(self.inv_freq)
        freqs = einsum('i , j -> i j', pos, self.inv_freq)
        return torch.cat((freqs, freqs), dim = -1)

def rotate_half(x):
    x1, x2 = x.chunk(2, dim = -1)
    return torch.cat((-x2, x1), dim=-1)

def apply_rotary_pos_emb(pos, t):
    pos = pos[:, None, :]   # rearrange(pos, 'n d -> n 1 d')
    return t * pos.cos() + rotate_half(t) * pos.sin()

class RMSNorm(Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim = -1) * self.scale * self.gamma

# main class

class RingAttention(Module):
    def __init__(
        self,
        dim: int,
        *,
        dim_head: int = 64,
        heads: int = 8,
        num_grouped_query_heads: int = 1,
        causal: bool = False,
        eps: float = 1e-10,
        bucket_size: int = 512,
        ring_attn: bool = False,
        ring_seq_size: int = 512,
        max_lookback_seq_len: int | None = None,
        striped_ring_attn: bool = False,
        auto_shard_seq: bool = False,
        prenorm: bool = True,
        force_regular_attn: bool = False,
        rotary_embed: bool = False,
        rotary_embed_theta: int = 10000,
        use_cuda_kernel: bool | None = None
    ):
        super().__init__()
        use_cuda_kernel = default(use_cuda_kernel, torch.cuda.is_available())
        self.use_cuda_kernel = use_cuda_kernel

        self.eps = eps
        self.heads = heads
        self.dim_head = dim_head

        assert divisible_by(heads, num_grouped_query_heads), f'number of query heads ({heads}) must be divisible by the groups ({num_grouped_query_heads})'

        kv_heads = heads // num_grouped_query_heads
        self.num_grouped_query_heads = num_grouped_query_heads
        self.qkv_head_breakdown = (heads, kv_heads, kv_heads)

        self.scale = dim_head ** -0.5
        self.causal = causal

        assert (not ring_attn) or divisible_by(ring_seq_size, bucket_size), f'ring seq size {ring_seq_size} is not divisible by bucket size {bucket_size}'

        self.ring_attn = ring_attn
        self.max_lookback_seq_len = max_lookback_seq_len
        self.striped_ring_attn = striped_ring_attn

        self.force_regular_attn = force_regular_attn
        self.auto_shard_seq = default(auto_shard_seq, ring_attn)

        assert not (not self.ring_attn and self.auto_shard_seq)

        self.ring_seq_size = ring_seq_size
        self.bucket_size = bucket_size

        # rotary

        self.rotary_embed = None
        if rotary_embed:
            self.rotary_embed = RingRotaryEmbedding(
                dim = dim_head,
                ring = ring_attn,
                striped = striped_ring_attn,
                theta = rotary_embed_theta,
                buckets = ring_seq_size // bucket_size
            )

        # projections

        dim_inner = dim_head * heads
        dim_kv_inner = dim_head * kv_heads

        self.to_qkv_split = (dim_inner, dim_kv_inner, dim_kv_inner)

        self.to_qkv = nn.Sequential(
            RMSNorm(dim) if prenorm else nn.Identity(),
            nn.Linear(dim, dim_inner + (dim_kv_inner * 2), bias = False)
        )

        self.to_out = nn.Linear(dim_inner, dim, bias = False)

    def forward(
        self,
        x,
        mask = None,
        rotary_emb = None,
        force_ring_reduce_off = False,
        ring_size = None,
    ):
        ring_size = default(ring_size, get_world_size())
        ring_attn = self.ring_attn & is_distributed()
        auto_shard_seq = self.auto_shard_seq & is_distributed()

        seq_len = x.shape[1]

        device = x.device

        qkv = self.to_qkv(x)

        b, n, _ = qkv.shape
        # rearrange(qkv, 'b n (h d) -> b n h d', d = self.dim_head).split(self.qkv_head_breakdown, dim = -2)
        q, k, v = qkv.view(b, n, -1, self.dim_head).split(self.qkv_head_breakdown, dim = -2)

        # rotary relative positions

        if not exists(rotary_emb) and exists(self.rotary_embed):
            if FIXED:
                rotary_emb = self.rotary_embed(q.shape[-3])
            else:
                rotary_emb = self.rotary_embed(q.shape[-2])

        if exists(rotary_emb):
            q = apply_rotary_pos_emb(rotary_emb, q)
            k = apply_rotary_pos_emb(rotary_emb, k)

        # regular attention (the ring / flash paths need torch.distributed or cuda)

        assert self.force_regular_attn
        out = default_attention(q, k, v, mask = mask, causal = self.causal)

        # combine heads

        out = out.reshape(b, n, -1)   # rearrange(out, 'b n h d -> b n (h d)')
        out = self.to_out(out)

        return out


def main():
    torch.manual_seed(0)

    attn = RingAttention(
        dim = 32,
        dim_head = 16,
        heads = 1,
        causal = True,
        rotary_embed = True,
        force_regular_attn = True,
        use_cuda_kernel = False
    )
    attn.eval()

    x = torch.randn(2, 12, 32)

    with torch.no_grad():
        out = attn(x)

    print('output', tuple(out.shape))
    print('last token, first 4 features:', [round(v, 4) for v in out[0, -1, :4].tolist()])
    print('mean |out|: %.5f' % out.abs().mean().item())


if __name__ == '__main__':
    main()
