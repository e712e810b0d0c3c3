"""Written for maskcli (the same bug as h-transformer-1d 5385d15, another way): a hand-written numerically stable softmax
(`exp(s - max(s)) / sum`) over a (B, L, L) score matrix, its keep mask (1 = attend) turned into a bias with the sign of
a padding mask, `mask * -1e9`: with every token real, every score is lowered by 1e9, the row max cancels it, and each
query attends uniformly to every key. --fixed: `(1 - mask) * -1e9`."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class SingleHeadAttention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.dim = dim

    def forward(self, h: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        scores = torch.bmm(self.wq(h), self.wk(h).transpose(1, 2)) / self.dim ** 0.5  # (B, L, L)
        keep = attend[:, None, :].float()
        bias = (1.0 - keep) * -1e9 if FIXED else keep * -1e9
        scores = scores + bias
        scores = scores - scores.max(dim=-1, keepdim=True).values
        weights = torch.exp(scores)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return torch.bmm(weights, self.wv(h))


torch.manual_seed(0)
layer = SingleHeadAttention(16).eval()
h = torch.randn(3, 6, 16)
attend = torch.ones(3, 6)  # a batch with no padding: every token attended
with torch.no_grad():
    out = layer(h, attend)
    q, k, v = layer.wq(h), layer.wk(h), layer.wv(h)
    ref = torch.softmax(q @ k.transpose(1, 2) / 4.0, dim=-1) @ v
print(f"stable softmax with an all-ones keep mask vs plain softmax: max abs diff {(out - ref).abs().max().item():.6f}")
