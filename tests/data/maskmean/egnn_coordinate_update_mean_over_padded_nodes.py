# The Uni-Mol bug (deepmodeling/Uni-Mol#211) written another way: an E(n)-equivariant layer over a left-padded batch of
# molecules (a bool `node_mask`, True on the real atoms) whose attention layer masks the pads, and whose coordinate
# update averages each atom's weighted differences over the atoms: the product first, then divided by each molecule's
# atom count, summed over the neighbours. The pads' differences (their coordinates 0) are summed too; the fix zeroes
# the padded pairs' weights before the sum.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class EquivariantBlock(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.embed = nn.Embedding(8, dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.edge = nn.Sequential(nn.Linear(2 * dim + 1, dim), nn.SiLU(), nn.Linear(dim, 1))

    def forward(self, atoms, pos, node_mask):
        h = self.embed(atoms)
        h = h + self.attn(h, h, h, key_padding_mask=~node_mask, need_weights=False)[0]
        n = h.shape[1]
        diff = pos[:, :, None, :] - pos[:, None, :, :]  # (B, N, N, 3)
        dist = (diff ** 2).sum(-1, keepdim=True)
        pair = torch.cat([h[:, :, None].expand(-1, -1, n, -1), h[:, None].expand(-1, n, -1, -1), dist], -1)
        weight = self.edge(pair)  # (B, N, N, 1)
        if FIXED:
            weight = weight * (node_mask[:, :, None] & node_mask[:, None, :])[..., None]
        count = node_mask.sum(-1).clamp(min=1)
        update = (diff * weight / count[:, None, None, None]).sum(2)
        return h, pos + update


model = EquivariantBlock().eval()
sizes = [9, 5, 7]
N = max(sizes)
atoms = torch.zeros(3, N, dtype=torch.long)
pos = torch.zeros(3, N, 3)
node_mask = torch.zeros(3, N, dtype=torch.bool)
for b, n in enumerate(sizes):
    atoms[b, N - n:] = torch.randint(1, 8, (n,))
    pos[b, N - n:] = torch.randn(n, 3)
    node_mask[b, N - n:] = True  # left padded
with torch.no_grad():
    _, moved = model(atoms, pos, node_mask)
    _, alone = model(atoms[1:2, N - 5:], pos[1:2, N - 5:], node_mask[1:2, N - 5:])
print(f"fixed={FIXED}  max |padded molecule - alone|: {float((moved[1, N - 5:] - alone[0]).abs().max()):.6f}")
