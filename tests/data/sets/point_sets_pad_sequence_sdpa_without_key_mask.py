# A point-set encoder in the style of a detection head's per-object pooling: the points of a batch of objects come
# flat, with a `batch` vector naming the object of each point; the encoder splits them by object, pads them with
# torch.nn.utils.rnn.pad_sequence (zeros after each object's points) and attends with SDPA, heads on their own axis.
# Before the fix it never built the key mask from those lengths, so each object's points attend the zero rows the
# smaller objects were padded with (its pooled feature changes with the largest object batched with it). The fix
# hands SDPA the (G, 1, 1, N) mask of real points.
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, real=None):
        g, n, c = x.shape
        q, k, v = self.qkv(x).view(g, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn_mask = real[:, None, None, :] if real is not None else None  # True = a real point
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return x + self.proj(out.transpose(1, 2).reshape(g, n, c))


class ObjectPointEncoder(nn.Module):
    def __init__(self, dim=24, heads=3, depth=2):
        super().__init__()
        self.layers = nn.ModuleList(SelfAttention(dim, heads) for _ in range(depth))

    def forward(self, points, batch):
        counts = torch.bincount(batch).tolist()
        dense = pad_sequence(list(points.split(counts)), batch_first=True)  # (G, N, C), zeros after each object
        real = torch.arange(dense.shape[1])[None, :] < torch.tensor(counts)[:, None]
        for layer in self.layers:
            dense = layer(dense, real if FIXED else None)
        pooled = (dense * real[..., None]).sum(1) / real.sum(1, keepdim=True)
        return pooled


encoder = ObjectPointEncoder().eval()
sizes = [4, 6, 2, 5]
points = torch.randn(sum(sizes), 24)
batch = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
with torch.no_grad():
    pooled = encoder(points, batch)
    start, diffs = 0, []
    for i, n in enumerate(sizes):
        alone = encoder(points[start:start + n], torch.zeros(n, dtype=torch.long))
        diffs.append((pooled[i] - alone[0]).abs().max().item())
        start += n
print(f"max |pooled in batch - pooled alone| per object: {[f'{d:.2e}' for d in diffs]}")
