"""A Qwen2.5-VL-style vision tower written another way: two images of different sizes packed in one sequence, each
block's attention an explicit softmax over scores filled with -inf outside its segments, the block's segments chosen
by a conditional expression read the wrong way round (the full blocks get the windows, the windowed ones the images).
`--fixed` reads it the right way round."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

DIM, HEADS, DEPTH, MERGE = 16, 2, 8, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x, cu):
        n = x.shape[0]
        q, k, v = self.qkv(self.norm(x)).view(n, 3, HEADS, -1).permute(1, 2, 0, 3)
        ids = torch.zeros(n, dtype=torch.long)
        for end in cu[1:-1].tolist():
            ids[end:] += 1
        scores = (q @ k.transpose(-1, -2)) / (q.shape[-1] ** 0.5)
        scores = scores.masked_fill(ids[:, None] != ids[None, :], float("-inf"))
        out = scores.softmax(-1) @ v
        return x + self.proj(out.transpose(0, 1).reshape(n, DIM))


class VisionTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.fullatt_block_indexes = [3, 7]

    def windows(self, grid):
        """(order of the patches window by window, cumulative window ends), MERGE x MERGE patches a window."""
        order, ends, start = [], [0], 0
        for h, w in grid:
            index = torch.arange(h * w).view(h // MERGE, MERGE, w // MERGE, MERGE).permute(0, 2, 1, 3).reshape(-1)
            order.append(index + start)
            for _ in range((h // MERGE) * (w // MERGE)):
                ends.append(ends[-1] + MERGE * MERGE)
            start += h * w
        return torch.cat(order), torch.tensor(ends)

    def forward(self, patches, grid):
        x = self.embed(patches)
        order, cu_window = self.windows(grid)
        x = x[order]
        cu_image = torch.tensor([0] + torch.tensor([h * w for h, w in grid]).cumsum(0).tolist())
        for number, block in enumerate(self.blocks):
            if FIXED:
                cu = cu_image if number in self.fullatt_block_indexes else cu_window
            else:
                cu = cu_window if number in self.fullatt_block_indexes else cu_image
            x = block(x, cu)
        return x[torch.argsort(order)]


if __name__ == "__main__":
    grid = [(4, 4), (2, 4)]
    tower = VisionTower().eval()
    with torch.no_grad():
        out = tower(torch.randn(24, 6), grid)
    print("fixed" if FIXED else "buggy", tuple(out.shape))
