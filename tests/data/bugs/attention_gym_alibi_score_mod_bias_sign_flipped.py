"""attention-gym's ALiBi score_mod for FlexAttention added the distance with the wrong sign.

Citation: meta-pytorch/attention-gym#86 ("fix alibi bias", commit 290c1e7, also fixes
attention-gym#29); the bug state of `attn_gym/mods/alibi.py` and `examples/flex_attn.ipynb`
read at 290c1e7^, the fix's diff read.

Bug: `generate_alibi_bias(H)` returned a score_mod computing
`bias = (q_idx - kv_idx) * scale`.  Under the causal block mask q_idx >= kv_idx, so the bias
is >= 0 and grows with distance: every query is pushed towards the *oldest* keys (the first
token most of all) instead of being penalised for distance, the opposite of ALiBi.
Fix: `bias = (kv_idx - q_idx) * scale` (ALiBi's linear penalty, 0 on the diagonal, negative
for past keys).

Reproduction: the attention-gym score_mod and the notebook's causal mask_mod (through
`create_block_mask`), used by a tiny causal ALiBi decoder (no positional embedding, as
ALiBi models have none) whose attention is `flex_attention(q, k, v, score_mod=...,
block_mask=...)` on CPU; a next-token loss over a short batch.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import (
    _score_mod_signature,
    create_block_mask,
    flex_attention,
)

FIXED = "--fixed" in sys.argv


# --- attn_gym/mods/alibi.py -------------------------------------------------------------
def generate_alibi_bias(H: int) -> _score_mod_signature:
    """Returns an alibi bias score_mod given the number of heads H"""

    def alibi_mod(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / H))
        if FIXED:
            bias = (kv_idx - q_idx) * scale
        else:
            bias = (q_idx - kv_idx) * scale
        return score + bias

    return alibi_mod


# --- examples/flex_attn.ipynb: the causal mask_mod --------------------------------------
def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class AlibiFlexAttention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.alibi_score_mod = generate_alibi_bias(n_heads)

    def forward(self, x, block_mask):
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = flex_attention(q, k, v, score_mod=self.alibi_score_mod, block_mask=block_mask)
        return self.proj(out.transpose(1, 2).reshape(B, S, D))


class Block(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = AlibiFlexAttention(dim, n_heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, block_mask):
        x = x + self.attn(self.ln1(x), block_mask)
        return x + self.mlp(self.ln2(x))


class AlibiLM(nn.Module):
    def __init__(self, vocab=64, dim=32, n_heads=4, n_layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, n_heads) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        B, S = idx.shape
        block_mask = create_block_mask(causal_mask, B=None, H=None, Q_LEN=S, KV_LEN=S, device="cpu")
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x, block_mask)
        return self.head(self.ln_f(x))


def main():
    torch.manual_seed(0)
    model = AlibiLM().eval()
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        logits = model(idx)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 64), idx[:, 1:].reshape(-1))
    print("fixed" if FIXED else "buggy", "loss", round(loss.item(), 6))
    print("last-token logits[0, :4]", logits[0, -1, :4].tolist())


if __name__ == "__main__":
    main()
