"""A masked-diffusion denoiser written as its own nn.Module, built with `is_causal=False` (kept on the model as
`self.is_causal`), over a right-padded batch: its attention blocks were copied from the autoregressive baseline, which
and-ed their padding mask with a causal triangle (SDPA, a bool keep-mask). --fixed: the blocks read the model's flag."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, keep, causal):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        mask = keep[:, None, None, :]
        if causal:
            mask = mask & torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, d)


class Denoiser(torch.nn.Module):
    def __init__(self, vocab=12, dim=16, heads=2, depth=2, is_causal=True):
        super().__init__()
        self.is_causal = is_causal
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, tokens, keep):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x, keep, self.is_causal if FIXED else True)
        return self.out(x)


torch.manual_seed(0)
model = Denoiser(is_causal=False).eval()
tokens = torch.tensor([[1, 2, 11, 4, 11, 0, 0], [3, 11, 5, 6, 7, 8, 11]])  # 11: the [MASK] id, 0: padding
with torch.no_grad():
    model(tokens, keep=tokens != 0)
