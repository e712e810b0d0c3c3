# The bug of SimpleTuner 295decc9b (Flux's true-CFG unconditional call handed no attention_mask) written another way: a
# PixArt-style DiT whose blocks cross-attend a T5 prompt padded to T tokens (not a joint attention), with
# a bool encoder_attention_mask turned into an additive bias; the sampler runs the unconditional call first, on the
# empty prompt's hidden states, and hands it no mask while it holds `null_mask`. The fix hands it null_mask.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class CrossAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, cond, bias=None):
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(cond).view(b, cond.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(out.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.cross = CrossAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, cond, t, bias):
        h = self.norm1(x) + t[:, None]
        x = x + self.self_attn(h, h, h, need_weights=False)[0]
        x = x + self.cross(self.norm2(x), cond, bias)
        return x + self.mlp(x)


class DiT(nn.Module):
    def __init__(self, channels=8, dim=32, heads=4, depth=2, text_dim=24):
        super().__init__()
        self.inp = nn.Linear(channels, dim)
        self.text = nn.Linear(text_dim, dim)
        self.time = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(depth)])
        self.outp = nn.Linear(dim, channels)

    def forward(self, x, timestep, encoder_hidden_states, encoder_attention_mask=None):
        bias = None
        if encoder_attention_mask is not None:  # (B, T) bool, True = a real token -> (B, 1, 1, T) additive
            bias = torch.zeros(encoder_attention_mask.shape, dtype=x.dtype)
            bias = bias.masked_fill(~encoder_attention_mask, float("-inf"))[:, None, None, :]
        x, cond = self.inp(x), self.text(encoder_hidden_states)
        t = self.time(timestep[:, None])
        for block in self.blocks:
            x = block(x, cond, t, bias)
        return self.outp(x)


def right_padded(lengths, total):
    positions = torch.arange(total)[None, :]
    return positions < torch.tensor(lengths)[:, None]


@torch.no_grad()
def sample(model, latents, text_states, text_mask, null_states, null_mask, steps=3, scale=4.5):
    for i in range(steps):
        t = torch.full((latents.shape[0],), 1.0 - i / steps)
        if FIXED:
            uncond = model(latents, t, null_states, encoder_attention_mask=null_mask)
        else:
            uncond = model(latents, t, null_states)
        cond = model(latents, t, text_states, encoder_attention_mask=text_mask)
        latents = latents - (uncond + scale * (cond - uncond)) / steps
    return latents


model = DiT().eval()
B, T, N = 2, 10, 12
text_mask = right_padded([7, 4], T)
null_mask = right_padded([1, 1], T)  # the empty prompt: one token
text_states = torch.randn(B, T, 24)
null_states = torch.randn(B, T, 24)
latents = sample(model, torch.randn(B, N, 8), text_states, text_mask, null_states, null_mask)
print("latents", tuple(latents.shape), f"{latents.abs().mean().item():.4f}")
