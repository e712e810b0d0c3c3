"""A right-padded batch whose key padding is spread over the heads with .repeat instead of .repeat_interleave: flattened
(batch * heads), head h of batch row b takes row (b * heads + h) % batch's padding. --fixed repeats each row's padding
for its own heads.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
HEADS = 2


class Encoder(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x, lengths):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        real = torch.arange(n)[None, :] < lengths[:, None]  # (b, n): True = a real token
        spread = real.repeat_interleave(HEADS, dim=0) if FIXED else real.repeat(HEADS, 1)  # (b * heads, n)
        mask = spread.view(b, HEADS, 1, n).expand(b, HEADS, n, n)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


def main():
    torch.manual_seed(0)
    model = Encoder().eval()
    with torch.no_grad():
        y = model(torch.randn(3, 6, 16), lengths=torch.tensor([6, 3, 5]))
    print("out", tuple(y.shape))


if __name__ == "__main__":
    main()
