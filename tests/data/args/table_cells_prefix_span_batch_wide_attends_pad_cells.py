# The surya reading-order bug (VikParuchuri/surya f82a06e: boxes unmasked as [0, box_count) over left padding) written
# another way: a table-structure decoder takes right-padded grid cells (row, column) with their `input_cells_mask` and
# lets the cells attend each other both ways before the causal structure tokens. The bidirectional span is unmasked up
# to the batch's longest cell count (`counts.max()`), not each row's, so a table with fewer cells has its real cells
# attend its PAD cells. The fix unmasks each row's own span [0, counts[b]).
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD_CELL = 31  # (row, column) = (31, 31): the pad cell


class CellDecoder(nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.rows, self.cols = nn.Embedding(32, dim), nn.Embedding(32, dim)
        self.heads = heads
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)

    def forward(self, input_cells, input_cells_mask):
        x = self.rows(input_cells[..., 0]) + self.cols(input_cells[..., 1])
        b, length = input_cells_mask.shape
        counts = input_cells_mask.sum(-1)
        blocked = torch.ones(length, length, dtype=torch.bool).triu(1)[None].repeat(b, 1, 1)  # causal: True = hidden
        blocked = blocked | (input_cells_mask == 0)[:, None, :]
        columns = torch.arange(length)[None, :]
        span = columns < (counts[:, None] if FIXED else counts.max())  # the cells attend each other both ways
        blocked = blocked & ~(span[:, None, :] & span[:, :, None])
        blocked = blocked & ~torch.eye(length, dtype=torch.bool)[None]  # (a pad row keeps itself: no NaN)
        y, _ = self.attn(x, x, x, attn_mask=blocked.repeat_interleave(self.heads, 0), need_weights=False)
        return self.norm(x + y)


model = CellDecoder().eval()
tables = [[(0, 0), (0, 1), (1, 0)], [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]]
width = max(len(t) for t in tables)
cells = torch.tensor([t + [(PAD_CELL, PAD_CELL)] * (width - len(t)) for t in tables])
mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in tables])
with torch.no_grad():
    out = model(cells, mask)
    other = cells.clone()
    other[mask == 0] = torch.tensor([7, 9])
    moved = (model(other, mask) - out).abs()[mask.bool()].max().item()
print(f"max |output change at real cells| when only the PAD cells change (should be 0): {moved:.6f}")
