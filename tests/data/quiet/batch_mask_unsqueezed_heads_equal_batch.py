"""A per-batch-row additive padding mask (B, L, L), kept by the kernel: the attention unsqueezes it over the heads.

Two sentences right-padded to 6 tokens (lengths 6 and 3), two heads: batch size and head count are equal, so the
(B, L, L) mask could broadcast over either axis; the program applies it per batch row (`mask[:, None]`), as written.
Every real query sees exactly its row's real keys; padded query rows see none (-1e9 everywhere: uniform weights,
never read). Correct: nothing was dropped.
"""
import torch

torch.manual_seed(0)
lengths = torch.tensor([6, 3])
batch, heads, length, dim = 2, 2, 6, 4
real = torch.arange(length)[None, :] < lengths[:, None]  # (B, L)
pair = real[:, :, None] & real[:, None, :]  # (B, L, L)
mask = torch.zeros(batch, length, length).masked_fill(~pair, -1e9)


def attend(q, k, v, mask):
    scores = q @ k.transpose(-1, -2) / dim ** 0.5 + mask[:, None]
    return scores.softmax(dim=-1) @ v


x = torch.randn(batch, heads, length, dim)
out = attend(x, x, x, mask)
print("out", tuple(out.shape), round(out[0].abs().mean().item(), 4))
