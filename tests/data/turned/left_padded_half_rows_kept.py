"""A correct left-padded encoder step whose padded row holds as many padding keys as real ones: read the other way
round (real tokens first) its mask is exactly that reading's padding, but its whole row sees every key, which no
turned mask does. --fixed is the same mask built as a float bias.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class Attention(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)

    def forward(self, x, pad):
        scores = self.q(x) @ self.k(x).transpose(1, 2) / 8 ** 0.5
        if FIXED:
            scores = scores + torch.zeros_like(scores).masked_fill(pad[:, None, :], float("-inf"))
        else:
            scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        return scores.softmax(dim=-1) @ x


def step(layer, x, src_lens):
    length = x.shape[1]
    pad = torch.arange(length)[None, :] < (length - src_lens)[:, None]  # left padding, True = padding
    return layer(x, pad)


def main():
    torch.manual_seed(0)
    with torch.no_grad():
        out = step(Attention().eval(), torch.randn(2, 6, 8), torch.tensor([3, 6]))
    print("out", tuple(out.shape))


if __name__ == "__main__":
    main()
