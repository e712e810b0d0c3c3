# Written another way for emptied-after-softmax (the Transformers4Rec 3d94628 bug, in another session recommender's
# style): hand-written attention over a left-padded batch of sessions (torch.softmax, einsum), the scores masked
# before the softmax (padding and later items, -1e9), and the probabilities then multiplied by `1 - future` where
# `future = torch.triu(ones, diagonal=0)` also takes the diagonal: each item's weight on itself is dropped and the
# first real item of each session reads nothing. The fix builds `future` with diagonal=1.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SessionEncoder(nn.Module):
    def __init__(self, n_items=40, d=16, heads=2):
        super().__init__()
        self.heads, self.d = heads, d
        self.items = nn.Embedding(n_items, d, padding_idx=0)
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, session):
        b, n = session.shape
        x = self.items(session)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.d // self.heads).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (self.d // self.heads) ** 0.5
        real = (session != 0)[:, None, None, :]
        later = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(~real | later, -1e9)
        probs = torch.softmax(scores, dim=-1)
        future = torch.triu(torch.ones(n, n), diagonal=1 if FIXED else 0)
        probs = probs * (1 - future)
        return torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, self.d)


model = SessionEncoder().eval()
session = torch.tensor([[0, 0, 7, 3, 12, 5], [4, 9, 2, 17, 8, 30]])
with torch.no_grad():
    out = model(session)
print(f"fixed={FIXED}: |output of the first real item of each session| = {out[0, 2].abs().sum().item():.3e}, "
      f"{out[1, 0].abs().sum().item():.3e}")
