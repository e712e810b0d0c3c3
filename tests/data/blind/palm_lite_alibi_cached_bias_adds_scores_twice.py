"""PaLM-lite (lucidrains/PaLM-pytorch): the cached ALiBi bias comes back with the scores already added.

Citation: lucidrains/PaLM-pytorch commit d78cd03 ("fix alibi in palm lite"), palm_pytorch/palm_lite.py
(`AlibiPositionalBias.forward`, used by `ParallelTransformerBlock.forward`).

Bug: `ParallelTransformerBlock.forward` does `sim = sim + self.alibi_pos_biases(sim)`.  On the first call
`AlibiPositionalBias.forward` builds the bias (-slope * |i - j|, zero for the heads past the slopes),
stores it in the `bias` buffer and returns it.  On every later call whose key length fits the buffer it
returns `qk_sim + self.bias[..., :i, :j]`, so the block computes 2 * sim + bias: the query-key scores are
counted twice and the ALiBi distance penalty is halved relative to them, for every forward pass after the
first (every training step, every evaluation batch of the same or shorter length).
Fix: the cached branch returns `self.bias[..., :i, :j]` only.

Reproduction: a tiny PaLM-lite (depth 2, 4 heads, multi-query attention, causal mask cache) scored on two
batches of the same length, as a training or evaluation loop does.  einops' `rearrange` is written out
with view/permute/unsqueeze.
"""
import sys
from math import floor, log2

import torch
import torch.nn.functional as F
from torch import einsum, nn

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None

# normalization

class RMSNorm(nn.Module):
    def __init__(self, dim, eps = 1e-8):
        super().__init__()
        self.scale = dim ** -0.5
        self.eps = eps
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        norm = torch.norm(x, dim = -1, keepdim = True) * self.scale
        return x / norm.clamp(min = self.eps) * self.g

# AliBi

class AlibiPositionalBias(nn.Module):
    def __init__(self, heads, **kwargs):
        super().__init__()
        self.heads = heads
        slopes = torch.Tensor(self._get_slopes(heads))
        slopes = slopes.view(-1, 1, 1)                       # rearrange(slopes, 'h -> h 1 1')
        self.register_buffer('slopes', slopes, persistent = False)
        self.register_buffer('bias', None, persistent = False)

    def get_bias(self, i, j, device):
        i_arange = torch.arange(i, device = device)
        j_arange = torch.arange(j, device = device)
        bias = -torch.abs(j_arange.view(1, 1, j) - i_arange.view(1, i, 1))
        return bias

    @staticmethod
    def _get_slopes(heads):
        def get_slopes_power_of_2(n):
            start = (2**(-2**-(log2(n)-3)))
            ratio = start
            return [start*ratio**i for i in range(n)]

        if log2(heads).is_integer():
            return get_slopes_power_of_2(heads)

        closest_power_of_2 = 2 ** floor(log2(heads))
        return get_slopes_power_of_2(closest_power_of_2) + get_slopes_power_of_2(2 * closest_power_of_2)[0::2][:heads-closest_power_of_2]

    def forward(self, qk_sim):
        h, i, j, device = *qk_sim.shape[-3:], qk_sim.device

        if exists(self.bias) and self.bias.shape[-1] >= j:
            if FIXED:
                return self.bias[..., :i, :j]
            return qk_sim + self.bias[..., :i, :j]

        bias = self.get_bias(i, j, device)
        bias = bias * self.slopes

        num_heads_unalibied = h - bias.shape[0]
        bias = F.pad(bias, (0, 0, 0, 0, 0, num_heads_unalibied))
        self.register_buffer('bias', bias, persistent=False)

        return bias

# residual

class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x) + x


class SwiGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x


# parallel attention and feedforward with residual

class ParallelTransformerBlock(nn.Module):
    def __init__(self, dim, dim_head=64, heads=8, ff_mult=4):
        super().__init__()
        self.norm = RMSNorm(dim)

        attn_inner_dim = dim_head * heads
        ff_inner_dim = dim * ff_mult
        self.fused_dims = (attn_inner_dim, dim_head, (ff_inner_dim * 2))

        self.heads = heads
        self.scale = dim_head**-0.5

        self.alibi_pos_biases = AlibiPositionalBias(heads = self.heads)

        self.fused_attn_ff_proj = nn.Linear(dim, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(attn_inner_dim, dim, bias=False)

        self.ff_out = nn.Sequential(
            SwiGLU(),
            nn.Linear(ff_inner_dim, dim, bias=False)
        )

        # for caching causal mask

        self.register_buffer("mask", None, persistent=False)

    def get_mask(self, n, device):
        if self.mask is not None and self.mask.shape[-1] >= n:
            return self.mask[:n, :n]

        mask = torch.triu(torch.ones((n, n), device=device, dtype=torch.bool), 1)
        self.register_buffer("mask", mask, persistent=False)
        return mask

    def forward(self, x):
        n, device, h = x.shape[1], x.device, self.heads

        # pre layernorm

        x = self.norm(x)

        # attention queries, keys or values (shared key / values), and feedforward inner

        q, kv, ff = self.fused_attn_ff_proj(x).split(self.fused_dims, dim=-1)

        # split heads: multi-query single-key-value attention

        b = q.shape[0]
        q = q.view(b, n, h, -1).permute(0, 2, 1, 3)        # rearrange(q, "b n (h d) -> b h n d", h = h)

        # scale

        q = q * self.scale

        # similarity

        sim = einsum("b h i d, b j d -> b h i j", q, kv)

        # add the alibi bias

        sim = sim + self.alibi_pos_biases(sim)

        # causal mask

        causal_mask = self.get_mask(n, device)
        sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)

        # attention

        attn = sim.softmax(dim=-1)
        out = einsum("b h i j, b j d -> b h i d", attn, kv)

        # merge heads

        out = out.permute(0, 2, 1, 3).reshape(b, n, -1)   # rearrange(out, "b h n d -> b n (h d)")

        merge_heads = self.attn_out(out) + self.ff_out(ff)
        return merge_heads

def PaLM(*, dim, num_tokens, depth, dim_head=64, heads=8, ff_mult=4):

    net = nn.Sequential(
        nn.Embedding(num_tokens, dim),
        *[Residual(ParallelTransformerBlock(dim, dim_head, heads, ff_mult)) for _ in range(depth)],
        RMSNorm(dim),
        nn.Linear(dim, num_tokens, bias=False)
    )

    # embedding weight tied projection out to logits

    net[-1].weight = net[0].weight

    nn.init.normal_(net[0].weight, std=0.02)
    return net


def main():
    torch.manual_seed(0)
    num_tokens, seq_len = 256, 16
    palm = PaLM(num_tokens = num_tokens, dim = 64, depth = 2, heads = 4, dim_head = 16)
    palm.eval()

    batches = [torch.randint(0, num_tokens, (2, seq_len + 1)) for _ in range(2)]
    with torch.no_grad():
        for step, data in enumerate(batches):
            inp, target = data[:, :-1], data[:, 1:]
            logits = palm(inp)
            loss = F.cross_entropy(logits.transpose(1, 2), target)
            print(f"batch {step}: loss {loss.item():.6f}  logits[0, -1, :3] {[round(v, 5) for v in logits[0, -1, :3].tolist()]}")


if __name__ == "__main__":
    main()
