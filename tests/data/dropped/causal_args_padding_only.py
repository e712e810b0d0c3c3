"""A decoder whose ModelArgs say causal=True, run on a right-padded batch with a hand-written softmax: the mask it
builds holds the padding only, the causal part forgotten (python FILE; --fixed: padding and causal together)."""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


@dataclass
class ModelArgs:
    dim: int = 16
    n_heads: int = 2
    causal: bool = True


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.qkv = nn.Linear(args.dim, 3 * args.dim)

    def forward(self, x, pad):
        b, n, d = x.shape
        h = self.args.n_heads
        q, k, v = (t.view(b, n, h, d // h).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / (d // h) ** 0.5
        keep = pad[:, None, None, :].bool()  # (b, 1, 1, n): the real keys
        if FIXED and self.args.causal:
            keep = keep & torch.ones(n, n, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)


def main():
    torch.manual_seed(0)
    model = Block(ModelArgs())
    x = torch.randn(2, 6, 16)
    pad = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])  # row 1 right-padded
    with torch.no_grad():
        out = model(x, pad)
    print("out[0,0,:3] =", [round(v, 4) for v in out[0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
