"""A point-cloud attention over each point's k nearest points (`self.num_neighbors = 2`), a left-padded batch whose
`node_pad_mask` is True = padding: the buggy layer ranks by `torch.cdist` over every point, so a padded point parked
near a real one takes a neighbour slot and is then hidden. --fixed ranks padded points last.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class KnnAttention(nn.Module):
    def __init__(self, width=8, heads=2, num_neighbors=2):
        super().__init__()
        self.num_neighbors = num_neighbors
        self.heads = heads
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * width)

    def forward(self, feats, points, node_pad_mask):
        b, n, d = feats.shape
        dist = torch.cdist(points, points)
        if FIXED:
            dist = dist.masked_fill(node_pad_mask[:, None, :], float("inf"))
        picked = dist.topk(self.num_neighbors, dim=-1, largest=False).indices  # (b, n, k)
        q = self.q(feats).view(b, n, self.heads, -1).permute(0, 2, 1, 3)  # (b, h, n, e)
        k, v = self.kv(feats).view(b, n, 2, self.heads, -1).permute(2, 0, 3, 1, 4)  # (b, h, n, e) each
        index = picked[:, None, :, :, None].expand(b, self.heads, n, self.num_neighbors, k.shape[-1])
        k_near = k[:, :, None].expand(b, self.heads, n, n, k.shape[-1]).gather(3, index)  # (b, h, n, k, e)
        v_near = v[:, :, None].expand(b, self.heads, n, n, v.shape[-1]).gather(3, index)
        scores = torch.einsum("bhie,bhije->bhij", q, k_near) / k.shape[-1] ** 0.5
        slot_pad = node_pad_mask.gather(1, picked.view(b, -1)).view(b, 1, n, self.num_neighbors)
        scores = scores.masked_fill(slot_pad | node_pad_mask[:, None, :, None], torch.finfo(scores.dtype).min)
        weights = scores.softmax(dim=-1)
        return torch.einsum("bhij,bhije->bhie", weights, v_near).permute(0, 2, 1, 3).reshape(b, n, d)


def main():
    torch.manual_seed(0)
    lengths = torch.tensor([5, 3])
    n = 5
    node_pad_mask = torch.arange(n)[None, :] < (n - lengths)[:, None]  # left padding, True = padding
    points = torch.randn(2, n, 3) * 4
    points[1, :2] = points[1, 2:4] + 0.01  # the padded points parked beside real ones
    feats = torch.randn(2, n, 8)
    layer = KnnAttention()
    with torch.no_grad():
        out = layer(feats, points, node_pad_mask)
    print("point 2 of cloud 1 out[:3]:", [round(x, 4) for x in out[1, 2, :3].tolist()])


if __name__ == "__main__":
    main()
