"""sentence-transformers#3509 written another way: an embedding wrapper in a plain-torch project keeps only the batch
fields its backbone's forward names (inspect.signature), and the backbone takes `forward(self, tokens, **extra)` and
reads `extra.get("pad_mask")`: the left-padded batch's pad_mask (True = padding) is filtered out, so every token
attends the padding through F.scaled_dot_product_attention. --fixed always hands on the fields every backbone reads.
"""
import inspect
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
ALWAYS = {"tokens", "pad_mask"}  # the fields every backbone reads, named or not


class Backbone(nn.Module):
    def __init__(self, vocab=40, width=16, heads=2, layers=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(layers))

    def forward(self, tokens, **extra):
        pad_mask = extra.get("pad_mask")  # (B, L), True = padding
        x = self.embed(tokens)
        b, n, d = x.shape
        keep = None if pad_mask is None else (~pad_mask)[:, None, None, :]
        for proj in self.qkv:
            q, k, v = proj(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            x = x + out.transpose(1, 2).reshape(b, n, d)
        return x


class Embedder(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone

    def forward(self, batch):
        named = set(inspect.signature(self.backbone.forward).parameters)
        wanted = named | ALWAYS if FIXED else named
        hidden = self.backbone(**{k: v for k, v in batch.items() if k in wanted})
        real = (~batch["pad_mask"]).float().unsqueeze(-1)
        return (hidden * real).sum(1) / real.sum(1)


def main():
    torch.manual_seed(0)
    rows = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15, 16, 17]]
    width = max(len(r) for r in rows)
    tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left padding with id 0
    batch = {"tokens": tokens, "pad_mask": tokens == 0}
    with torch.no_grad():
        emb = Embedder(Backbone().eval())(batch)
    print("embeddings", tuple(emb.shape))


if __name__ == "__main__":
    main()
