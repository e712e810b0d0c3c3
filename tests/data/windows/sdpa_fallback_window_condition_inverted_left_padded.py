# Written another way than keras-team/keras-hub#2289 (Qwen3Attention's `if not self.sliding_window_size:`): a decoder
# layer that holds its window as FlashAttention does, `window_size = (3, 0)` (keys p - 3 .. p; (-1, -1) = none), and
# whose SDPA fallback (a bool mask over left-padded prompts) tests it the wrong way round: `if self.window_size[0] < 0:`
# bands the mask only when no window is configured, so each query sees its whole prefix. The fix: `>= 0`.
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class WindowedAttention(torch.nn.Module):
    def __init__(self, dim: int, heads: int, window_size: tuple[int, int] = (-1, -1)):
        super().__init__()
        self.heads, self.head_dim, self.window_size = heads, dim // heads, window_size
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)

    def build_mask(self, keep: torch.Tensor) -> torch.Tensor:
        """(B, 1, L, L) bool, True = attend: causal, the left padding's keys hidden, banded to the window."""
        length = keep.shape[1]
        pos = torch.arange(length)
        allowed = pos[None, :] <= pos[:, None]  # (L, L) causal
        left = self.window_size[0]
        windowed = left >= 0 if FIXED else left < 0
        if windowed:
            allowed = allowed & (pos[:, None] - pos[None, :] <= left)  # keys p - left .. p
        allowed = allowed[None] & keep[:, None, :].bool()
        allowed = allowed | torch.eye(length, dtype=torch.bool)[None]  # (a pad query sees itself: no NaN rows)
        return allowed[:, None]

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, length, d = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.build_mask(keep))
        return self.o(out.transpose(1, 2).reshape(b, length, d))


B, L, D = 3, 9, 16
layer = WindowedAttention(D, heads=2, window_size=(3, 0))
lengths = [9, 6, 4]
keep = torch.zeros(B, L, dtype=torch.long)
for row, n in enumerate(lengths):
    keep[row, L - n:] = 1  # left-padded
x = torch.randn(B, L, D)
with torch.no_grad():
    out = layer(x, keep)
print(f"output {tuple(out.shape)}, mean {out.mean().item():.6f}")
