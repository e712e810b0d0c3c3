# Written another way for queries-called-padding (the awslabs/gluonts 8e2e909 bug, in the style of a next-item
# recommender): a sequence-first nn.MultiheadAttention over left-padded click histories in which only the last click
# queries (`attn(h[-1:], h, h, ...)`), handed the keep mask `ids != 0` (True = a real click) as key_padding_mask,
# which MHA reads as True = ignore: the last click attends only the left padding (a history with none attends nothing).
# The fix passes `ids == 0`.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class LastClickAttention(nn.Module):
    def __init__(self, n_items=40, d=16, heads=4, max_len=8):
        super().__init__()
        self.items = nn.Embedding(n_items, d, padding_idx=0)
        self.positions = nn.Embedding(max_len, d)
        self.attn = nn.MultiheadAttention(d, heads)          # (L, B, E): sequence first
        self.score = nn.Linear(d, n_items)

    def forward(self, ids):
        h = (self.items(ids) + self.positions(torch.arange(ids.shape[1]))).transpose(0, 1)   # (L, B, E)
        real = ids != 0
        pad = ~real if FIXED else real
        out, _ = self.attn(h[-1:], h, h, key_padding_mask=pad)
        return self.score(out[0])


model = LastClickAttention().eval()
ids = torch.tensor([[0, 0, 0, 5, 9, 2, 17, 3],
                    [0, 0, 0, 0, 0, 8, 12, 6],
                    [0, 4, 11, 7, 7, 21, 30, 14]])
with torch.no_grad():
    batched = model(ids)
    alone = model(ids[1:2, 5:])
print(f"fixed={FIXED}: |scores of history 1 in the batch - alone| = {(batched[1] - alone[0]).abs().max().item():.3e}")
