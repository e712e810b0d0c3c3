"""Feedback Transformer: the FIFO memory is truncated on the batch axis, so it never shrinks to mem_len.

Citation: lucidrains/feedback-transformer-pytorch commit 683bba1a85b037c09539db65c7193e0c83919f62
("final fix", version 0.0.5 -> 0.0.6). Read in the upstream git history (parent and fix commit);
there is no issue thread for it.

Bug: `FeedbackTransformer.forward` processes the input in segments of `seq_len` tokens. After each
segment it appends the aggregated hidden states' keys/values (`shared_kv_proj`) to
`memory_keys` / `memory_values` of shape (batch, mem_positions, inner_dim) and then "enforces max
length on memory buffer" with `memory_keys[-self.mem_len:]`, which slices dimension 0, the batch.
With batch <= mem_len that is a no-op: the memory keeps every past position and each segment's
queries attend to the whole history instead of the last `mem_len` memory slots.
Fix: slice the memory-position axis, `memory_keys[:, -self.mem_len:]` (same for values).

This program: the pre-fix module as published (einops `rearrange` written as view/permute),
`mem_len=3`, `seq_len=2`, batch 2, 8 tokens = 4 segments; the memory passed to the 4th segment
holds 6 positions when buggy, 3 when fixed.
"""
import math
import sys
from collections import namedtuple

import torch
import torch.nn.functional as F
from torch import einsum, nn

FIXED = "--fixed" in sys.argv

Memory = namedtuple('Memory', ['keys', 'values'])


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def safe_cat(arr, el, dim=1):
    if not exists(arr):
        return el
    return torch.cat((arr, el), dim=dim)


class RelativePositionBias(nn.Module):
    def __init__(self, causal=False, num_buckets=32, max_distance=128, heads=8):
        super().__init__()
        self.causal = causal
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)

    @staticmethod
    def _relative_position_bucket(relative_position, causal=True, num_buckets=32, max_distance=128):
        ret = 0
        n = -relative_position
        if not causal:
            num_buckets //= 2
            ret += (n < 0).long() * num_buckets
            n = torch.abs(n)
        else:
            n = torch.max(n, torch.zeros_like(n))
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = max_exact + (
            torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
        ).long()
        val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
        ret += torch.where(is_small, n, val_if_large)
        return ret

    def forward(self, qk_dots):
        i, j, device = *qk_dots.shape[-2:], qk_dots.device
        q_pos = torch.arange(i, dtype=torch.long, device=device)
        k_pos = torch.arange(j, dtype=torch.long, device=device)
        rel_pos = k_pos[None, :] - q_pos[:, None]
        rp_bucket = self._relative_position_bucket(rel_pos, causal=self.causal, num_buckets=self.num_buckets, max_distance=self.max_distance)
        values = self.relative_attention_bias(rp_bucket)
        return values.permute(2, 0, 1).unsqueeze(0)  # 'i j h -> () h i j'


class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(x, **kwargs) + x


class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)


class GEGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return F.gelu(gate) * x


class FeedForward(nn.Module):
    def __init__(self, *, dim, mult=4, dropout=0.):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult * 2), GEGLU(), nn.Dropout(dropout), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class Attention(nn.Module):
    def __init__(self, *, dim, heads=8, dim_head=64, dropout=0.):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        inner_dim = dim_head * heads
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, memory=None, pos_emb=None):
        h, n, device = self.heads, x.shape[1], x.device
        q = self.to_q(x) * self.scale
        k, v = self.to_kv(x).chunk(2, dim=-1)
        if exists(memory):
            mem_k, mem_v = memory
            k = torch.cat((mem_k, k), dim=1)
            v = torch.cat((mem_v, v), dim=1)
        # 'b n (h d) -> b h n d'
        q, k, v = map(lambda t: t.view(t.shape[0], t.shape[1], h, -1).transpose(1, 2), (q, k, v))
        sim = einsum('b h i d, b h j d -> b h i j', q, k)
        i, j = sim.shape[-2:]
        if exists(pos_emb):
            sim += pos_emb(sim)
        if n > 1:
            causal_mask = torch.ones(i, j, device=device).triu_(j - i + 1).bool()
            causal_mask = causal_mask[None, None]
            mask_value = -torch.finfo(q.dtype).max
            sim.masked_fill_(causal_mask, mask_value)
        attn = sim.softmax(dim=-1)
        attn = self.dropout(attn)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)  # 'b h n d -> b n (h d)'
        return out


class FeedbackTransformer(nn.Module):
    def __init__(self, *, num_tokens, dim, depth, mem_len, seq_len=2, heads=8, dim_head=64, attn_dropout=0., ff_dropout=0.):
        super().__init__()
        self.seq_len = seq_len
        self.mem_len = mem_len
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = RelativePositionBias(causal=True, heads=heads)
        self.layers = nn.ModuleList([])
        shared_kv_proj = None
        for _ in range(depth):
            attn = Attention(dim=dim, heads=heads, dim_head=dim_head, dropout=attn_dropout)
            ff = FeedForward(dim=dim, dropout=ff_dropout)
            shared_kv_proj = default(shared_kv_proj, attn.to_kv)
            attn.to_kv = shared_kv_proj
            self.layers.append(nn.ModuleList([Residual(PreNorm(dim, attn)), Residual(PreNorm(dim, ff))]))
        self.layer_weight = nn.Parameter(torch.ones(depth))
        self.shared_kv_proj = shared_kv_proj
        self.to_logits = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_tokens))

    def forward(self, x, memory=None, return_memory=False):
        b, n, device = *x.shape, x.device
        x = self.token_emb(x)
        memory_keys = None
        memory_values = None
        if exists(memory):
            memory_keys, memory_values = memory
        outputs = []
        layer_weight = self.layer_weight.softmax(dim=-1)
        layer_weight = self.layer_weight[:, None, None, None]  # 'd -> d () () ()' (as published)
        self.memory_lengths = []
        for x in x.split(self.seq_len, dim=1):
            hiddens = []
            memory = None
            if exists(memory_keys):
                memory = (memory_keys, memory_values)
                self.memory_lengths.append(memory_keys.shape[1])
            for attn, ff in self.layers:
                hiddens.append(x)
                x = attn(x, memory=memory, pos_emb=self.pos_emb)
                x = ff(x)
            outputs.append(x)
            hiddens = torch.stack(hiddens)
            agg_hiddens = (hiddens * layer_weight).sum(dim=0)
            mem_k, mem_v = self.shared_kv_proj(agg_hiddens).chunk(2, dim=-1)
            memory_keys = safe_cat(memory_keys, mem_k, dim=1)
            memory_values = safe_cat(memory_values, mem_v, dim=1)
            # enforce max length on memory buffer
            if FIXED:
                memory_keys = memory_keys[:, -self.mem_len:]
                memory_values = memory_values[:, -self.mem_len:]
            else:
                memory_keys = memory_keys[-self.mem_len:]
                memory_values = memory_values[-self.mem_len:]
        x = torch.cat((outputs), dim=1)
        out = self.to_logits(x)
        if not return_memory:
            return out
        return out, Memory(memory_keys, memory_values)


def main():
    torch.manual_seed(0)
    model = FeedbackTransformer(num_tokens=20, dim=32, depth=2, mem_len=3, seq_len=2, heads=4, dim_head=8).eval()
    x = torch.randint(0, 20, (2, 8))
    with torch.no_grad():
        logits = model(x)
    print("memory positions seen per segment:", model.memory_lengths)
    print("last-token logits[0, :4]:", [round(v, 4) for v in logits[0, -1, :4].tolist()])


if __name__ == "__main__":
    main()
