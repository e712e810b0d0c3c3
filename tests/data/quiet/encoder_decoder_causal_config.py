"""A hand-written encoder-decoder whose one config dataclass says causal=True (for its decoder); the encoder layers
are built with causal=False and attend both ways over the source (correct)."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 16
    n_heads: int = 2
    causal: bool = True


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, causal: bool):
        super().__init__()
        self.h = args.n_heads
        self.causal = causal
        self.qkv = nn.Linear(args.dim, 3 * args.dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal).transpose(1, 2).reshape(b, t, d)


class Seq2Seq(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.encoder = Attention(args, causal=False)
        self.decoder = Attention(args, causal=args.causal)

    def forward(self, src, tgt):
        memory = self.encoder(src)
        return self.decoder(tgt + memory.mean(1, keepdim=True))


def main():
    torch.manual_seed(0)
    with torch.no_grad():
        out = Seq2Seq(ModelArgs()).eval()(torch.randn(1, 6, 16), torch.randn(1, 5, 16))
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
