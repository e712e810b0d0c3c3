"""A decoder mixing a positional prior into its causal attention weights after the softmax, the prior unmasked.

Written for checks/weighted.py another way than molecule-attention-transformer 23c9cbe (an adjacency term added to
(B, H, N, N) weights over padded atoms): a causal decoder whose heads are folded into the batch, (B * H, T, T) scores
from torch.bmm with a -inf causal fill, then `attn = (1 - mix) * attn + mix * prior`, a prior over positions by their
distance |i - j| normalised over every key, the later ones included: each token reads the tokens after it. `--fixed`
masks the prior causally and renormalises it over the keys each query may see.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class PriorMixedCausalAttention(nn.Module):
    def __init__(self, dim=16, heads=2, mix=0.3):
        super().__init__()
        self.heads, self.mix = heads, mix
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, t, d = x.shape
        h, dh = self.heads, d // self.heads
        q, k, v = (y.reshape(b, t, h, dh).transpose(1, 2).reshape(b * h, t, dh) for y in self.qkv(x).chunk(3, dim=-1))
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = torch.bmm(q, k.transpose(1, 2)) / dh ** 0.5
        attn = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        position = torch.arange(t, dtype=x.dtype)
        closeness = torch.exp(-(position[:, None] - position[None, :]).abs() / 2.0)
        if FIXED:
            closeness = closeness * causal
        prior = closeness / closeness.sum(dim=-1, keepdim=True)
        attn = (1 - self.mix) * attn + self.mix * prior
        out = torch.bmm(attn, v).reshape(b, h, t, dh).transpose(1, 2).reshape(b, t, d)
        return out


def main():
    torch.manual_seed(0)
    layer = PriorMixedCausalAttention().eval()
    x = torch.randn(2, 6, 16)
    x_changed = x.clone()
    x_changed[:, 4:] += 1.0  # only the last two tokens change
    with torch.no_grad():
        leak = float((layer(x)[:, :4] - layer(x_changed)[:, :4]).abs().max())
    print(f"fixed={FIXED} change of outputs 0-3 after changing tokens 4-5: {leak:.6f}")


if __name__ == "__main__":
    main()
