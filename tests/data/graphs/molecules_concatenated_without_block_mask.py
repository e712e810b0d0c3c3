"""A graph transformer layer over a mini-batch of molecules concatenated atom after atom (PyG style, `batch_index`
says which molecule each atom is of): the buggy layer attends over all atoms with no mask, so each atom sees the other
molecules' atoms. --fixed adds a -inf block mask between molecules (SDPA, float mask).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class GraphAttention(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x, batch_index):
        n, d = x.shape
        q, k, v = self.qkv(x).view(1, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        bias = None
        if FIXED:
            same = batch_index[:, None] == batch_index[None, :]
            bias = torch.zeros(n, n).masked_fill(~same, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return out.transpose(1, 2).reshape(n, d)


def main():
    torch.manual_seed(0)
    atoms_per_molecule = torch.tensor([3, 4, 2])
    batch_index = torch.repeat_interleave(torch.arange(3), atoms_per_molecule)
    x = torch.randn(int(atoms_per_molecule.sum()), 16)
    layer = GraphAttention()
    with torch.no_grad():
        out = layer(x, batch_index)
    print("atom 0 out[:3]:", [round(v, 4) for v in out[0, :3].tolist()])


if __name__ == "__main__":
    main()
