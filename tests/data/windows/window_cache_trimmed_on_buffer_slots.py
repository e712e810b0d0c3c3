"""A sliding layer whose cache trims on its buffer's slots, not the tokens it holds: decode loses the window's keys.

Written apart from mlx-lm#1673's chunked cache: a window (not chunks) stated in a dict the model keeps
(`self.cfg["sliding_window"]`), a batch of two rows with its attention_mask, an eager softmax over `q @ k^T` with an additive -inf mask.
The cache grows its buffer 4 slots at a time; before each step it keeps the last W - 1 keys so that the new one
makes W. Bug: it counts the buffer's unfilled slots as keys (`self.k.shape[2]`), so after the prompt it keeps
only empty slots and the next query sees itself alone. Fix: trim on the tokens held (`offset - start`).
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
D, SLOTS = 8, 4


class Cache:
    def __init__(self, window):
        self.k = self.v = None
        self.offset = self.start = 0
        self.window = window

    def trim(self):
        if self.k is None:
            return
        held = self.offset - self.start if FIXED else self.k.shape[2]
        cut = held - (self.window - 1)
        if cut > 0:
            self.k, self.v = self.k[:, :, cut:held], self.v[:, :, cut:held]
            self.start += cut

    def add(self, k, v):
        held, n = self.offset - self.start, k.shape[2]
        if self.k is None or held + n > self.k.shape[2]:
            size = -(-(held + n) // SLOTS) * SLOTS
            new_k, new_v = k.new_zeros(k.shape[0], k.shape[1], size, D), v.new_zeros(v.shape[0], v.shape[1], size, D)
            if self.k is not None:
                new_k[:, :, :held], new_v[:, :, :held] = self.k[:, :, :held], self.v[:, :, :held]
            self.k, self.v = new_k, new_v
        self.k[:, :, held:held + n], self.v[:, :, held:held + n] = k, v
        self.offset += n
        return self.k[:, :, :held + n], self.v[:, :, :held + n]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.cfg = {"sliding_window": 4, "num_hidden_layers": 1, "hidden_size": D}
        self.qkv = nn.Linear(D, 3 * D)
        self.cache = Cache(self.cfg["sliding_window"])

    def forward(self, x, attention_mask):
        self.cache.trim()
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        keys, values = self.cache.add(k, v)
        kpos = torch.arange(self.cache.start, self.cache.offset)
        qpos = torch.arange(self.cache.offset - x.shape[1], self.cache.offset)
        allowed = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - self.cfg["sliding_window"])
        allowed = allowed & attention_mask[:, None, None, self.cache.start:self.cache.offset].bool()
        scores = q @ keys.transpose(-1, -2) / D ** 0.5 + torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        return (scores.softmax(-1) @ values).squeeze(1)


torch.manual_seed(0)
model = Model()
with torch.no_grad():
    mask = torch.ones(2, 5, dtype=torch.long)  # (the padding mask generate hands, one longer each step)
    out = model(torch.randn(2, 5, D), mask)
    for _ in range(6):
        mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
        out = model(out[:, -1:], mask)
print("done", tuple(out.shape), "start", model.cache.start)
