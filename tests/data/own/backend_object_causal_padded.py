# An attention backend kept as a plain object (no nn.Module), called through __call__ by each layer, that states
# `is_causal=True` yet applies only the batch's key padding mask: a right-padded batch's real queries see the later
# real keys. Fixed: the backend ANDs a lower triangle into the keep mask it builds.
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class EagerBackend:
    """Dense attention over (B, H, L, D); `key_valid` (B, L) True where the key is a real token."""

    scale: float
    is_causal: bool = False

    def __call__(self, q, k, v, key_valid):
        scores = q @ k.transpose(-1, -2) * self.scale
        keep = key_valid[:, None, None, :]
        if FIXED and self.is_causal:
            L = q.shape[-2]
            keep = keep & torch.ones(L, L, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


class DecoderLayer(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.backend = EagerBackend(scale=1 / math.sqrt(width // heads), is_causal=True)

    def forward(self, x, key_valid):
        B, L, W = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, W // self.heads).permute(2, 0, 3, 1, 4)
        y = self.backend(q, k, v, key_valid).transpose(1, 2).reshape(B, L, W)
        return x + self.proj(y)


class TinyLM(nn.Module):
    def __init__(self, vocab=50, width=32, heads=4, depth=2, pad_id=0):
        super().__init__()
        self.pad_id = pad_id
        self.embed = nn.Embedding(vocab, width, padding_idx=pad_id)
        self.layers = nn.ModuleList(DecoderLayer(width, heads) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids):
        key_valid = input_ids != self.pad_id
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, key_valid)
        return self.head(h)


model = TinyLM().eval()
input_ids = torch.randint(1, 50, (3, 9))
input_ids[1, 6:] = 0  # right-padded rows
input_ids[2, 4:] = 0
with torch.no_grad():
    full = model(input_ids)
    prefix = model(input_ids[:, :3])
print(f"fixed={FIXED} row 0, position 2: full vs prefix = {(full[0, 2] - prefix[0, 2]).abs().max().item():.3e}")
