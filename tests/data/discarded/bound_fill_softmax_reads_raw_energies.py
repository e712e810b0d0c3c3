"""A padded batch's encoder whose masked energies are bound to a name the softmax never reads.

Written for checks/discarded.py another way than arghosh/AKT 01b7e8d (a no-peek mask, `scores_ =
scores.masked_fill(...)` then `scores_ = F.softmax(scores)`): a Transformer encoder layer over a right-padded batch, its
key padding filled into the energies as `energy_masked = energy.masked_fill(pad, float("-inf"))`, and the softmax
handed `energy` (the name before it), so the real tokens attend the padding; einsum for both products. `--fixed`
softmaxes `energy_masked`.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class EncoderSelfAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.dim_head = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, pad):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.dim_head).permute(2, 0, 3, 1, 4)
        energy = torch.einsum("bhid,bhjd->bhij", q, k) * self.dim_head ** -0.5
        energy_masked = energy.masked_fill(pad[:, None, None, :], float("-inf"))
        attention = torch.softmax(energy_masked if FIXED else energy, dim=-1)
        context = torch.einsum("bhij,bhjd->bhid", attention, v)
        return self.out(context.transpose(1, 2).reshape(b, n, -1))


def main():
    torch.manual_seed(0)
    layer = EncoderSelfAttention().eval()
    lengths = torch.tensor([6, 4])
    x = torch.randn(2, 6, 16)
    pad = torch.arange(6)[None, :] >= lengths[:, None]  # True = padding (right-padded)
    with torch.no_grad():
        batched = layer(x, pad)[1, :4]
        alone = layer(x[1:, :4], pad[1:, :4])[0]
    print(f"fixed={FIXED} max |row 1 batched - alone| {float((batched - alone).abs().max()):.6f}")


if __name__ == "__main__":
    main()
