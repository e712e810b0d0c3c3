# The same bug as FuxiCTR 9d89a67 (#130), written another way: a SASRec-style self-attention over a user's history,
# histories of different lengths padded on the right with pad_sequence (zero feature vectors), einsum scores. The
# module builds its causal + key-padding mask from the float `mask` it is handed and never adds it to the scores, so
# every behavior attends the zero padding after it (and the behaviors after it). The fix adds it as -1e9 * (1 - mask).
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class HistorySelfAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.scale = 1.0 / math.sqrt(dim)

    def build_mask(self, mask):
        """(B, L, L) float: 1.0 where query i may read key j (j <= i and j real)."""
        length = mask.shape[1]
        causal = torch.tril(torch.ones(length, length, device=mask.device))
        return causal[None] * mask[:, None, :]

    def forward(self, history, mask):
        scores = torch.einsum("bid,bjd->bij", self.q(history), self.k(history)) * self.scale
        allowed = self.build_mask(mask)
        if FIXED:
            scores = scores + (1.0 - allowed) * -1e9
        weights = F.softmax(scores, dim=-1)
        return torch.einsum("bij,bjd->bid", weights, self.v(history))


dim = 8
histories = [torch.randn(n, dim) for n in (5, 2, 7)]  # per-user behavior features, of different lengths
history = pad_sequence(histories, batch_first=True)  # (3, 7, 8): zeros after each user's last behavior
mask = pad_sequence([torch.ones(len(h)) for h in histories], batch_first=True)  # 1.0 real, 0.0 padding
model = HistorySelfAttention(dim).eval()
with torch.no_grad():
    out = model(history, mask)
    moved = history.clone()
    moved[1, 2:] = 5.0  # change only what sits in user 1's padding
    out2 = model(moved, mask)
print("max |change| of user 1's real outputs when only its padding changes:",
      round(float((out2[1, :2] - out[1, :2]).abs().max()), 6))
