# Written another way (checks/pooledend.py, pooled-before-end): a hand-written causal text tower (SDPA over a bool mask,
# causal and key padding, right-padded prompts) returning its (B, L, D) output; the caller pools it OUTSIDE the model at
# `input_ids.argmax(-1)`, meant as the end-of-text token, the largest id of the base vocabulary. Two prompts hold a
# token added after it (id 20 > eos 19: a new concept token), so they are pooled at that token, mid-prompt.
# --fixed: pooled at each row's first end-of-text token, `(input_ids == EOS).int().argmax(-1)`.
# Correct readings of the same tower, for the rule's quiet side: --both-ways (no causal part: a position sees every
# token, argmax pooling or not) and --prompt-end (each row read at the last token of its prompt, a response after it:
# no row read at its end).
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
BOTH_WAYS, PROMPT_END = "--both-ways" in sys.argv, "--prompt-end" in sys.argv
torch.manual_seed(0)
EOS, PAD, ADDED = 19, 0, 20


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, allowed):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class TextTower(nn.Module):
    def __init__(self, vocab=21, dim=32, heads=4, layers=2, length=10):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.randn(length, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.final = nn.LayerNorm(dim)

    def forward(self, input_ids, attention_mask):
        n = input_ids.shape[1]
        x = self.tokens(input_ids) + self.positions[:n]
        causal = torch.ones(n, n, dtype=torch.bool) if BOTH_WAYS else torch.ones(n, n, dtype=torch.bool).tril()
        allowed = (causal[None] & attention_mask.bool()[:, None, :])[:, None]  # (B, 1, L, L)
        for block in self.blocks:
            x = block(x, allowed)
        return self.final(x)


prompts = [[3, 7, ADDED, 11, 5, EOS], [4, 9, 2, 8, 6, 1, 12, EOS], [5, ADDED, 14, EOS]]
length = max(map(len, prompts))
input_ids = torch.tensor([p + [PAD] * (length - len(p)) for p in prompts])
attention_mask = torch.tensor([[1] * len(p) + [0] * (length - len(p)) for p in prompts])
tower = TextTower().eval()
with torch.no_grad():
    features = tower(input_ids, attention_mask)
    at = (input_ids == EOS).int().argmax(-1) if FIXED else input_ids.argmax(-1)
    if PROMPT_END:  # (the prompts' last tokens: 3, 4 and 1 tokens before their end)
        at = torch.tensor([2, 3, 2])
    pooled = F.normalize(features[torch.arange(len(prompts)), at], dim=-1)
print("pooled at", at.tolist(), "similarities", [round(float(x), 4) for x in (pooled @ pooled.T)[0]])
