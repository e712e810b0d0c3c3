"""A batched generation loop that calls its model's `forward` directly (no module call of the model runs, only its
layers'): the left-padded prompts are attended with is_causal=True alone, pads included; `--fixed` builds the padding
mask from the ids at the embedding's padding_idx and hands it to SDPA. Written as a second form of turboderp/exllama
899aaa0 (batched generate_simple never passed the padding mask), differently: the pad id stated only by
nn.Embedding(padding_idx=...), SDPA in place of a softmax written out, a batch of three."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
PAD = 5


class Attention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(d, 3 * d)
        self.cache = None

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.cache is not None:
            k, v = torch.cat([self.cache[0], k], 2), torch.cat([self.cache[1], v], 2)
        self.cache = (k, v)
        if keep is None:  # (one query over the cache: bottom-right causal is every key)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return out.transpose(1, 2).reshape(b, n, d)


class Model(nn.Module):
    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=PAD)
        self.blocks = nn.ModuleList(Attention(d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens, real=None):
        h = self.embed(tokens)
        keep = None
        if real is not None:
            n, total = tokens.shape[1], real.shape[1]
            causal = torch.ones(n, total, dtype=torch.bool).tril(total - n)
            keep = (causal[None] & real[:, None, :])[:, None]
            keep = keep | ~real[:, -n:, None][:, None]  # (a pad query sees every key: no row without one)
        for block in self.blocks:
            h = h + block(h, keep)
        return self.head(h)


@torch.no_grad()
def generate(model, tokens, steps):
    real = tokens != PAD if FIXED else None
    logits = model.forward(tokens, real)
    for _ in range(steps):
        token = logits[:, -1:].argmax(-1)
        tokens = torch.cat([tokens, token], 1)
        if real is not None:
            real = torch.cat([real, torch.ones_like(token, dtype=torch.bool)], 1)
        logits = model.forward(token, real)
    return tokens


torch.manual_seed(0)
model = Model().eval()
prompts = torch.tensor([[PAD, PAD, PAD, 7, 8], [PAD, 9, 10, 11, 12], [13, 14, 15, 16, 17]])
print("fixed" if FIXED else "buggy", generate(model, prompts, 3)[:, -3:].tolist())
