"""Attention weights "sharpened" by a second softmax over the probabilities, in a right-padded batch.

Written for checks/weighted.py another way than DisKT#2 (a no-peek mask, a counter-attention zeroing, then
`F.softmax(p_attn)`): a set encoder over a right-padded batch of (B, H, N, N) scores from matmul, the key padding
filled with the dtype's lowest value, then `attn = (attn / self.temperature).softmax(-1)` to sharpen the weights: the
padded keys' weight 0 becomes exp(0), so every real element attends the padding. `--fixed` divides the scores by the
temperature before the one softmax.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class SharpenedAttention(nn.Module):
    def __init__(self, dim=16, heads=4, temperature=0.5):
        super().__init__()
        self.heads, self.temperature = heads, temperature
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))

    def forward(self, x, key_padding):
        b, n, d = x.shape
        split = lambda t: t.view(b, n, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = split(self.to_q(x)), split(self.to_k(x)), split(self.to_v(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        scores = scores.masked_fill(key_padding[:, None, None, :], torch.finfo(scores.dtype).min)
        if FIXED:
            attn = (scores / self.temperature).softmax(dim=-1)
        else:
            attn = scores.softmax(dim=-1)
            attn = (attn / self.temperature).softmax(dim=-1)
        return torch.matmul(attn, v).transpose(1, 2).reshape(b, n, d)


def main():
    torch.manual_seed(0)
    layer = SharpenedAttention().eval()
    x = torch.randn(2, 7, 16)
    key_padding = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])
    with torch.no_grad():
        batched = layer(x, key_padding)[1, :5]
        alone = layer(x[1:, :5], key_padding[1:, :5])[0]
    print(f"fixed={FIXED} max |set 1 batched - alone| {float((batched - alone).abs().max()):.6f}")


if __name__ == "__main__":
    main()
