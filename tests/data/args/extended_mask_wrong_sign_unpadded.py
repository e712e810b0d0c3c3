"""A BERT-style encoder whose extended attention mask is built as mask * -10000 instead of (1 - mask) * -10000: on a batch
with no padding every key of every row is pushed down alike. --fixed builds (1 - mask) * -10000.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Encoder(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x, attention_mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        keep = attention_mask[:, None, None, :].to(x.dtype)
        extended = (1.0 - keep) * -10000.0 if FIXED else keep * -10000.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=extended).transpose(1, 2).reshape(b, n, d)


def main():
    torch.manual_seed(0)
    with torch.no_grad():
        y = Encoder().eval()(torch.randn(2, 5, 16), attention_mask=torch.ones(2, 5, dtype=torch.long))
    print("out", tuple(y.shape))


if __name__ == "__main__":
    main()
