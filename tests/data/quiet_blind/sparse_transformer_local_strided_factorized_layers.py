"""OpenAI Sparse Transformer, strided factorization: layers alternate 'local' and 'strided' masks.

Follows openai/sparse_attention attention.py (get_attn_mask, attention_impl), ported to torch.
An 8x8 image is generated in raster order (n_ctx=64) with local_attn_ctx=8 (one image row).
get_attn_mask builds a 0/1 float mask: 'local' = the last 8 positions incl. self
(matrix_band_part(ones, 7, 0)); 'strided' = every earlier position at a distance divisible by 8
(same column) incl. self. attention_impl applies it as `w * mask + -1e9 * (1 - mask)` before the
softmax (the mask multiplies the logits and then adds -1e9, not a plain additive mask). Layers
alternate local, strided, so after two layers every pixel has a path from every earlier pixel.
Mask meant: layer 0, 2: causal band of width 8; layer 1, 3: causal, keys j with (i - j) % 8 == 0.
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn


def get_attn_mask(n, attn_mode, local_attn_ctx=None):
    if attn_mode == "all":
        b = torch.tril(torch.ones(n, n))
    elif attn_mode == "local":
        bandwidth = local_attn_ctx
        ctx = min(n - 1, bandwidth - 1)
        # matrix_band_part(ones, ctx, 0): ctx diagonals below the main one, none above
        b = torch.tril(torch.ones(n, n)) - torch.tril(torch.ones(n, n), -ctx - 1)
    elif attn_mode == "strided":
        stride = local_attn_ctx
        x = torch.arange(n, dtype=torch.int32).reshape(n, 1)
        y = x.t()
        z = torch.zeros(n, n, dtype=torch.int32)
        q = z + x
        k = z + y
        c1 = q >= k
        c2 = torch.remainder(q - k, stride) == 0
        b = (c1 & c2).float()
    else:
        raise ValueError("Not yet implemented")
    return b.reshape(1, 1, n, n)


def split_heads(x, n):
    b, t, m = x.shape
    return x.reshape(b, t, n, m // n).transpose(1, 2)


def merge_heads(x):
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def attention_impl(q, k, v, heads, attn_mode, local_attn_ctx=None):
    q, k, v = split_heads(q, heads), split_heads(k, heads), split_heads(v, heads)
    n_timesteps = k.shape[2]
    mask = get_attn_mask(n_timesteps, attn_mode, local_attn_ctx)
    w = q @ k.transpose(-1, -2)
    w = w * (1.0 / math.sqrt(q.shape[-1]))
    w = w * mask + -1e9 * (1 - mask)
    w = F.softmax(w, dim=-1)
    return merge_heads(w @ v)


class SparseBlock(nn.Module):
    def __init__(self, n_embd, heads, attn_mode, local_attn_ctx):
        super().__init__()
        self.heads, self.attn_mode, self.local_attn_ctx = heads, attn_mode, local_attn_ctx
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.c_proj(attention_impl(q, k, v, self.heads, self.attn_mode, self.local_attn_ctx))
        return x + self.mlp(self.ln_2(x))


class SparseImageTransformer(nn.Module):
    def __init__(self, hps):
        super().__init__()
        self.wte = nn.Embedding(hps.n_vocab, hps.n_embd)
        self.wpe = nn.Parameter(torch.randn(hps.n_ctx, hps.n_embd) * 0.02)
        modes = ["local", "strided"]
        self.blocks = nn.ModuleList([
            SparseBlock(hps.n_embd, hps.n_head, modes[i % 2], hps.local_attn_ctx) for i in range(hps.n_layer)])
        self.ln_f = nn.LayerNorm(hps.n_embd)
        self.head = nn.Linear(hps.n_embd, hps.n_vocab, bias=False)

    def forward(self, pixels):
        x = self.wte(pixels) + self.wpe[: pixels.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--n_ctx", type=int, default=64)
    parser.add_argument("--local_attn_ctx", type=int, default=8)
    parser.add_argument("--n_embd", type=int, default=32)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_vocab", type=int, default=16)
    hps = parser.parse_args()
    torch.manual_seed(0)
    model = SparseImageTransformer(hps).eval()
    pixels = torch.randint(0, hps.n_vocab, (2, hps.n_ctx))
    with torch.no_grad():
        logits = model(pixels)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, hps.n_vocab), pixels[:, 1:].reshape(-1))
    print("logits", tuple(logits.shape), "nll %.3f" % loss.item())
