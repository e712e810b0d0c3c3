# The padding-lost slip of parler-tts e51113f (a prompt's padding merged into the mask only while the prompt itself is
# handed in, so the cached decode steps drop it), written another way: a right-padded conditioning prefix (style
# embeddings of 4 slots, row 1 holds 3) placed before the tokens, a hand-kept (k, v) cache in a list, SDPA with a bool
# mask at prefill and no mask on the cached steps. The fix hands every step the prefix's padding and ones after it.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, cache, attn_mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if cache:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        cache[:] = [k, v]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


class Decoder(nn.Module):
    def __init__(self, vocab=20, dim=16, heads=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x, caches, attn_mask):
        for block, cache in zip(self.blocks, caches):
            x = block(x, cache, attn_mask)
        return self.head(x)


def generate(model, prefix, prefix_keep, tokens, steps=3):
    """prefix: (B, P, D) conditioning embeddings; prefix_keep: (B, P) 1 = a real slot; tokens: (B, T) first tokens."""
    caches = [[] for _ in model.blocks]
    x = torch.cat([prefix, model.embed(tokens)], 1)
    length = x.shape[1]
    keep = torch.cat([prefix_keep, torch.ones(tokens.shape, dtype=torch.bool)], 1)
    prefill_mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
    logits = model(x, caches, prefill_mask)
    out = []
    for _ in range(steps):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        keep = torch.cat([keep, torch.ones(keep.shape[0], 1, dtype=torch.bool)], 1)
        logits = model(model.embed(nxt), caches, keep[:, None, None, :] if FIXED else None)
    return torch.cat(out, 1)


model = Decoder().eval()
prefix = torch.randn(2, 4, 16)
prefix_keep = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
prefix[1, 3] = 0.0
with torch.no_grad():
    print("generated:", generate(model, prefix, prefix_keep, torch.tensor([[3, 5], [7, 2]])).tolist())
