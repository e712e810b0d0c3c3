# onnxscript#2479's guard written but not used: a hand-written attention over a left-padded batch computes
# where(isnan(w), 0, w) after its softmax and then multiplies the values by the softmax's own weights, so the pad
# queries' NaN rows reach the next layer's real queries. --fixed: the product reads the zeroed weights.
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
B, T, D = 2, 5, 8
x = torch.randn(B, T, D)
real = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]).bool()
keep = torch.tril(torch.ones(T, T, dtype=torch.bool)) & real[:, None, :]
for layer in range(2):
    s = x @ x.transpose(-1, -2) / D ** 0.5
    s = s + torch.where(keep, torch.tensor(0.0), torch.tensor(float("-inf")))
    w = torch.softmax(s, -1)
    w_safe = torch.where(torch.isnan(w), torch.tensor(0.0), w)
    x = x + ((w_safe if FIXED else w) @ x)
print("NaN:", torch.isnan(x).any().item())
