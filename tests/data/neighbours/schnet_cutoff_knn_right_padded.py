"""A molecular k-nearest-neighbour attention that also states a distance cutoff (`self.n_neighbors = 3`,
`self.cutoff = 2.5`, as SchNet / DimeNet-style interaction blocks hold one), over a right-padded batch given as
`atom_lens`: the buggy block ranks every atom, padding included, so padded atoms parked beside real ones take a
nearest-neighbour slot and are hidden after; neighbours beyond the cutoff are hidden too (the farthest slots, which
is no bug). Scores by matmul over the gathered keys, a keep mask through torch.where. --fixed ranks padded atoms last.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class CutoffKnnBlock(nn.Module):
    def __init__(self, width=12, heads=3, n_neighbors=3, cutoff=2.5):
        super().__init__()
        self.n_neighbors = n_neighbors
        self.cutoff = cutoff
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)

    def forward(self, h, pos, atom_lens):
        b, n, d = h.shape
        real = torch.arange(n)[None, :] < atom_lens[:, None]  # (b, n)
        dist = (pos[:, :, None, :] - pos[:, None, :, :]).pow(2).sum(-1).sqrt()
        dist = dist + torch.eye(n) * 1e6  # never oneself
        if FIXED:
            dist = dist.masked_fill(~real[:, None, :], 1e6)
        near_dist, near = torch.sort(dist, dim=-1)
        near_dist, near = near_dist[..., :self.n_neighbors], near[..., :self.n_neighbors]  # (b, n, k), ascending
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, -1).unbind(2)  # (b, n, h, e) each
        rows = torch.arange(b)[:, None, None]
        k_near, v_near = k[rows, near], v[rows, near]  # (b, n, k, h, e)
        scores = torch.matmul(q.permute(0, 2, 1, 3)[..., None, :],
                              k_near.permute(0, 3, 1, 4, 2)).squeeze(-2) / q.shape[-1] ** 0.5  # (b, h, n, k)
        keep = (near_dist <= self.cutoff) & real[rows, near]  # within the cutoff, a real atom
        scores = torch.where(keep[:, None], scores, torch.tensor(-1e9))
        weights = scores.softmax(-1)
        out = torch.matmul(weights[..., None, :], v_near.permute(0, 3, 1, 2, 4)).squeeze(-2)  # (b, h, n, e)
        return out.permute(0, 2, 1, 3).reshape(b, n, d)


def main():
    torch.manual_seed(1)
    atom_lens = torch.tensor([5, 7])
    n = 7
    pos = torch.randn(2, n, 3)
    pos[0, 4] = pos[0, 4] + 6.0  # an atom far from the rest: its neighbours lie beyond the cutoff
    pos[0, 5:] = pos[0, 1:3] + 0.05  # the padded atoms parked beside real ones
    h = torch.randn(2, n, 12)
    block = CutoffKnnBlock()
    with torch.no_grad():
        out = block(h, pos, atom_lens)
    print("atom 0 of molecule 0 out[:3]:", [round(x, 4) for x in out[0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
