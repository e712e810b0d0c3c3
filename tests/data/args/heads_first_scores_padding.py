"""Hand-written attention whose scores are laid out heads first, (H, B, Lq, Lk): correct, and quiet.

The heads are split off the front (q.view(B, L, H, D).permute(2, 0, 1, 3)), as attention-learn-to-route's glimpse
does, and each batch row's key padding is laid as pad[None, :, None, :] on the batch axis, dim 1. Read as
(B, H, Lq, Lk), the heads would be batch rows (all alike) and the batch rows heads (each its own padding): a batch
mask "on the heads axis" that the program never wrote. The module holds its head count (num_heads = 2, batch 3);
with --unstated it keeps it under a name that states nothing (self.h). The program checks its output against a
double loop over batch rows and heads, a softmax over each row's real keys.
"""
import sys

import torch
from torch import nn

UNSTATED = "--unstated" in sys.argv


class HeadsFirst(nn.Module):
    def __init__(self, width=8, heads=2):
        super().__init__()
        if UNSTATED:
            self.h = heads
        else:
            self.num_heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)

    def forward(self, x, valid):  # x (B, L, C), valid (B, L) bool
        heads = self.h if UNSTATED else self.num_heads
        b, n, c = x.shape
        q, k, v = (t.reshape(b, n, heads, c // heads).permute(2, 0, 1, 3) for t in self.qkv(x).chunk(3, -1))
        scores = torch.matmul(q, k.transpose(-1, -2)) / (c // heads) ** 0.5  # (H, B, Lq, Lk)
        scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
        return torch.matmul(scores.softmax(dim=-1), v), (q, k, v)  # (H, B, L, D)


def main():
    torch.manual_seed(0)
    lengths = [5, 3, 4]
    valid = torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]
    model = HeadsFirst().eval()
    with torch.no_grad():
        y, (q, k, v) = model(torch.randn(3, 5, 8), valid)
        for b, real in enumerate(lengths):  # the reference: each (row, head), its real keys only
            for h in range(q.shape[0]):
                weights = (q[h, b] @ k[h, b, :real].T / q.shape[-1] ** 0.5).softmax(-1)
                assert torch.allclose(y[h, b], weights @ v[h, b, :real], atol=1e-5), (b, h)
    print("heads first", tuple(y.shape), f"{y.abs().mean().item():.4f}")


if __name__ == "__main__":
    main()
