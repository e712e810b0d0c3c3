"""A plain-torch ring of calls, left-padded by lengths, additive float mask; decode keeps only the padding."""
import sys
import torch

FIXED = "--fixed" in sys.argv
WINDOW = 4
lengths = torch.tensor([3, 7])
B, L, D = 2, 7, 8
torch.manual_seed(1)


def attend(q, k, v, bias):
    s = q @ k.transpose(-1, -2) / D ** 0.5 + bias
    return s.softmax(-1) @ v


start = L - lengths  # left padding: row b's first real token
k = v = torch.randn(B, 1, L, D)
i = torch.arange(L)
real = i[None, :] >= start[:, None]
allowed = real[:, None, :] & (i[None, :, None] >= i[None, None, :]) & (i[None, :, None] - i[None, None, :] < WINDOW)
bias = torch.zeros(B, L, L).masked_fill(~allowed, float("-inf")).masked_fill(~real[:, :, None], 0.0)
attend(k, k, v, bias[:, None])
for step in range(3):
    n = k.shape[2]
    new = torch.randn(B, 1, 1, D)
    k = v = torch.cat([k, new], 2)
    j = torch.arange(n + 1)
    ok = j[None, :] >= start[:, None]
    if FIXED:
        ok &= n - j[None, :] < WINDOW
    attend(new, k, v, torch.zeros(B, 1, 1, n + 1).masked_fill(~ok[:, None, None, :], float("-inf")))
