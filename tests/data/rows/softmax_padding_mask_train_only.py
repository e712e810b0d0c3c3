"""A hand-written text encoder given a key_padding_mask (True = padding) for a right-padded batch, whose eager softmax
applies it only while training: in eval the real tokens attend the padding and nothing is masked anywhere
(--fixed: the padding masked in every mode)."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class SelfAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, key_padding_mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * (d // self.heads) ** -0.5
        if self.training or FIXED:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], torch.finfo(scores.dtype).min)
        return x + torch.einsum("bhqk,bhkd->bqhd", scores.softmax(-1), v).reshape(b, n, d)


class TextEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList([SelfAttention(), SelfAttention()])

    def forward(self, tokens, key_padding_mask):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, key_padding_mask)
        return x.masked_fill(key_padding_mask[..., None], 0).sum(1)


def main():
    torch.manual_seed(0)
    encoder = TextEncoder().eval()
    tokens = torch.tensor([[4, 8, 15, 16, 23, 42], [7, 11, 13, 1, 1, 1]])
    pad = tokens == 1
    with torch.no_grad():
        pooled = encoder(tokens, pad)
    print("pooled", pooled.sum(-1).tolist())


if __name__ == "__main__":
    main()
