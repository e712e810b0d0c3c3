# A bool padding mask added in place to the scores (the bug of coleygroup/DiffMS#25 written another way): a
# trajectory encoder over left-padded agent histories keeps `valid` (B, L), True on real steps, builds the additive
# bias from it, then adds the bool itself with `scores.add_(...)`: torch counts it as 0 and 1, so the padded steps
# stay attended. The fix adds the bias (0 on real steps, -1e9 on padding).
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class HistoryEncoder(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, steps, valid):
        B, L, D = steps.shape
        q, k, v = self.qkv(steps).view(B, L, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.head_dim ** 0.5
        keep = valid[:, None, None, :]  # (B, 1, 1, L)
        bias = (~keep).float() * -1e9
        scores.add_(bias if FIXED else keep)
        weights = scores.softmax(dim=-1)
        return self.out(torch.matmul(weights, v).transpose(1, 2).reshape(B, L, D))


encoder = HistoryEncoder().eval()
lengths = [6, 3, 5]
L = max(lengths)
valid = torch.tensor([[i >= L - n for i in range(L)] for n in lengths])  # left padding: the latest steps are real
steps = torch.randn(len(lengths), L, 16) * valid[..., None]
with torch.no_grad():
    batched = encoder(steps, valid)
    alone = [encoder(steps[b:b + 1, L - n:], valid[b:b + 1, L - n:])[0] for b, n in enumerate(lengths)]
diff = max((batched[b, L - n:] - alone[b]).abs().max().item() for b, n in enumerate(lengths))
print(f"max |batched - alone| on real steps: {diff:.6f}")
