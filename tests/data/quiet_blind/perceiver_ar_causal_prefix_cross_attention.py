"""Perceiver AR: the last 8 positions cross-attend causally to a 24-token prefix plus themselves.

Follows lucidrains/perceiver-ar-pytorch perceiver_ar_pytorch/perceiver_ar_pytorch.py
(CausalPrefixAttention, CausalAttention, PerceiverAR.forward with prefix_mask). The sequence of 32
tokens is split at cross_attn_seq_len=24: the prefix only provides keys/values; the 8 latent
positions are the queries. Keys are [prefix ; latents] (32 keys for 8 queries), masked by
`ones(i, j).triu(j - i + 1)`: the causal diagonal is aligned to the bottom-right, so latent t sees the
whole prefix and latents <= t. `prefix_mask` (True = keep) hides left padding in the prefix of the
second sample; it is padded with True over the latent keys. The later layers are causal
self-attention over the 8 latents only (8 x 8, same triu formula with i == j).
Mask meant: perceive layer [8 x 32]: key j visible to query t iff j <= 24 + t and prefix_mask[j]
(True beyond 24); self layers: plain causal 8 x 8.
"""
import torch
import torch.nn.functional as F
from torch import nn


def FeedForward(dim, mult=4):
    return nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * mult, bias=False), nn.GELU(),
                         nn.Linear(dim * mult, dim, bias=False))


class RotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, max_seq_len):
        seq = torch.arange(max_seq_len, dtype=self.inv_freq.dtype)
        freqs = torch.einsum("i,j->ij", seq, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(pos, t):
    # queries take the last positions: latents sit at the end of the sequence
    seq_len, rotate_dim = t.shape[-2], pos.shape[-1]
    pos = pos[..., -seq_len:, :]
    t, t_pass = t[..., :rotate_dim], t[..., rotate_dim:]
    t = (t * pos.cos()) + (rotate_half(t) * pos.sin())
    return torch.cat((t, t_pass), dim=-1)


def split_heads(t, h):
    b, n, _ = t.shape
    return t.reshape(b, n, h, -1).transpose(1, 2)


class CausalAttention(nn.Module):
    def __init__(self, *, dim, dim_head=16, heads=4):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, dim_head * heads * 3, bias=False)
        self.to_out = nn.Linear(dim_head * heads, dim, bias=False)

    def forward(self, x, rotary_pos_emb=None):
        x = self.norm(x)
        q, k, v = (split_heads(t, self.heads) for t in self.to_qkv(x).chunk(3, dim=-1))
        q = q * self.scale
        q = apply_rotary_pos_emb(rotary_pos_emb, q)
        k = apply_rotary_pos_emb(rotary_pos_emb, k)
        sim = torch.einsum("bhid,bhjd->bhij", q, k)
        i, j = sim.shape[-2:]
        causal_mask = torch.ones((i, j), dtype=torch.bool).triu(j - i + 1)
        sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)
        out = torch.einsum("bhij,bhjd->bhid", sim.softmax(dim=-1), v)
        return self.to_out(out.transpose(1, 2).flatten(2))


class CausalPrefixAttention(nn.Module):
    def __init__(self, *, dim, dim_head=16, heads=4):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.context_norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_kv = nn.Linear(dim, dim_head * heads * 2, bias=False)
        self.to_out = nn.Linear(dim_head * heads, dim)

    def forward(self, x, context, context_mask=None, rotary_pos_emb=None):
        x = self.norm(x)
        context = self.context_norm(context)
        q = self.to_q(x)
        k_input, v_input = self.to_kv(x).chunk(2, dim=-1)
        k_context, v_context = self.to_kv(context).chunk(2, dim=-1)
        k = torch.cat((k_context, k_input), dim=1)
        v = torch.cat((v_context, v_input), dim=1)
        q, k, v = (split_heads(t, self.heads) for t in (q, k, v))
        q = q * self.scale
        q = apply_rotary_pos_emb(rotary_pos_emb, q)
        k = apply_rotary_pos_emb(rotary_pos_emb, k)
        sim = torch.einsum("bhid,bhjd->bhij", q, k)
        i, j = sim.shape[-2:]
        mask_value = -torch.finfo(sim.dtype).max
        if context_mask is not None:
            mask_len = context_mask.shape[-1]
            context_mask = F.pad(context_mask, (0, max(j - mask_len, 0)), value=True)
            sim = sim.masked_fill(~context_mask[:, None, None, :], mask_value)
        causal_mask = torch.ones((i, j), dtype=torch.bool).triu(j - i + 1)
        sim = sim.masked_fill(causal_mask, mask_value)
        out = torch.einsum("bhij,bhjd->bhid", sim.softmax(dim=-1), v)
        return self.to_out(out.transpose(1, 2).flatten(2))


class PerceiverAR(nn.Module):
    def __init__(self, *, num_tokens, dim, depth, max_seq_len, cross_attn_seq_len, dim_head=16, heads=4):
        super().__init__()
        assert max_seq_len > cross_attn_seq_len
        self.max_seq_len = max_seq_len
        self.cross_attn_seq_len = cross_attn_seq_len
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.rotary_pos_emb = RotaryEmbedding(dim=max(8, dim_head // 2))
        self.perceive_layers = nn.ModuleList([nn.ModuleList([
            CausalPrefixAttention(dim=dim, dim_head=dim_head, heads=heads), FeedForward(dim)])])
        self.layers = nn.ModuleList([nn.ModuleList([
            CausalAttention(dim=dim, dim_head=dim_head, heads=heads), FeedForward(dim)]) for _ in range(depth)])
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)

    def forward(self, x, prefix_mask=None):
        seq_len = x.shape[1]
        assert self.cross_attn_seq_len < seq_len <= self.max_seq_len
        x = self.token_emb(x) + self.pos_emb(torch.arange(seq_len))
        rotary_pos_emb = self.rotary_pos_emb(seq_len)
        prefix, x = x[:, :self.cross_attn_seq_len], x[:, self.cross_attn_seq_len:]
        for cross_attn, ff in self.perceive_layers:
            x = cross_attn(x, prefix, context_mask=prefix_mask, rotary_pos_emb=rotary_pos_emb) + x
            x = ff(x) + x
        for attn, ff in self.layers:
            x = attn(x, rotary_pos_emb=rotary_pos_emb) + x
            x = ff(x) + x
        return self.to_logits(x)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = PerceiverAR(num_tokens=50, dim=64, depth=2, max_seq_len=32, cross_attn_seq_len=24).eval()
    seq = torch.randint(1, 50, (2, 32))
    prefix_mask = torch.ones(2, 24, dtype=torch.bool)
    prefix_mask[1, :10] = False          # second sample: prompt left-padded by 10 tokens
    seq[1, :10] = 0
    with torch.no_grad():
        logits = model(seq, prefix_mask=prefix_mask)
    print("logits for the last 8 positions", tuple(logits.shape))
