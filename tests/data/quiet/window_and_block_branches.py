"""Two attention branches in one forward (native-sparse-attention style, hand-written): a sliding branch under the
module's window_size=(2, 0) and a block-causal branch (each query sees its own block of 4 up to itself), summed. The
block branch sees further back than the window at a block's last query: it is another branch, not the window dropped
(correct). `--drop`: the sliding branch masks causality alone, so no call of the run keeps to the window (the bug)."""
import sys

import torch
import torch.nn.functional as F
from torch import nn

DROP = "--drop" in sys.argv


class TwoBranch(nn.Module):
    def __init__(self, d=16, h=2, block=4):
        super().__init__()
        self.h, self.block = h, block
        self.window_size = (2, 0)
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        causal = j <= i
        sliding = causal if DROP else causal & (i - j <= self.window_size[0])
        block = causal & (i // self.block == j // self.block)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=block)
        out = out + F.scaled_dot_product_attention(q, k, v, attn_mask=sliding)
        return x + out.transpose(1, 2).reshape(b, t, d)


def main():
    torch.manual_seed(0)
    with torch.no_grad():
        out = TwoBranch().eval()(torch.randn(2, 8, 16))
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
