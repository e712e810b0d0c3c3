# Written another way than keras-team/keras#20488: a hand-written cross-attention (eager masked_fill, no keras) whose
# (T, S) monotonic-alignment band mask -- query t reads source frames 2t - 1 .. 2t + 1 -- is grown to 4-D with
# unsqueeze(1) twice, (T, 1, 1, S), so batch element b gets band row b for every query (it runs because B == T).
# The fix broadcasts it over the batch and the heads: attention_mask[None, None].
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def band(queries: int, keys: int) -> torch.Tensor:
    """1 where query t may read source frame s: |s - 2t| <= 1."""
    t = torch.arange(queries)[:, None]
    s = torch.arange(keys)[None, :]
    return ((s - 2 * t).abs() <= 1).long()


class CrossAttention(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, memory, attention_mask):
        b, t, d = x.shape
        s = memory.shape[1]
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(memory).view(b, s, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / self.head_dim ** 0.5  # (b, h, t, s)
        if FIXED:
            grown = attention_mask[None, None]  # (1, 1, t, s): the same band for every batch row and head
        else:
            grown = attention_mask
            while grown.dim() < 4:
                grown = grown.unsqueeze(1)  # (t, 1, 1, s): the query axis on the batch axis
        scores = scores.masked_fill(grown == 0, float("-inf"))
        weights = scores.softmax(dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, t, d))


B, T, S, D = 4, 4, 8, 16
layer = CrossAttention(D, heads=2)
x, memory = torch.randn(B, T, D), torch.randn(B, S, D)
with torch.no_grad():
    out = layer(x, memory, band(T, S))
print(f"output {tuple(out.shape)}, mean {out.mean().item():.6f}")
