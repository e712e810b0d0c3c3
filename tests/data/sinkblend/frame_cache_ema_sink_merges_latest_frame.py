# The bug of JaydenLyh/Reward-Forcing#5 written another way: a LongLive-style frame-by-frame rollout whose cache is a
# list of per-frame K/V (a config dataclass the model holds states frame_seq_length, local_attn_size, sink_size),
# rotate_half RoPE over 1-D positions applied when the keys are laid out for the call, a batch of two. When the
# window is full the oldest frame leaves and should be merged into the EMA sink; the buggy cache merges the newest
# frame still in the window (frames[-1]) instead. --fixed merges the frame that left.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class RolloutConfig:
    dim: int = 32
    heads: int = 2
    frame_seq_length: int = 3
    local_attn_size: int = 4  # frames kept, the sink frame among them
    sink_size: int = 1
    ema_decay: float = 0.95


def rope(x, positions):
    half = x.shape[-1] // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = positions[:, None].float() * inv[None, :]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class FrameCache:
    def __init__(self, cfg):
        self.cfg, self.sink, self.frames = cfg, None, []

    def add(self, k, v):
        cfg = self.cfg
        if self.sink is None:
            self.sink = (k, v)
            return
        self.frames.append((k, v))
        if len(self.frames) > cfg.local_attn_size - cfg.sink_size:
            left = self.frames.pop(0)
            merged = left if FIXED else self.frames[-1]
            d = cfg.ema_decay
            self.sink = (d * self.sink[0] + (1 - d) * merged[0], d * self.sink[1] + (1 - d) * merged[1])

    def keys(self):
        held = [self.sink, *self.frames]
        return torch.cat([k for k, _ in held], 2), torch.cat([v for _, v in held], 2)


class FrameAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x, cache):
        b, n, _ = x.shape
        h = self.cfg.heads
        q, k, v = self.qkv(x).view(b, n, 3, h, -1).permute(2, 0, 3, 1, 4)
        cache.add(k, v)
        keys, values = cache.keys()
        kpos = torch.arange(keys.shape[2])
        qpos = torch.arange(keys.shape[2] - n, keys.shape[2])
        out = F.scaled_dot_product_attention(rope(q, qpos), rope(keys, kpos), values)
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


class FrameModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.attn = FrameAttention(cfg)

    def forward(self, frame, cache):
        return frame + self.attn(frame, cache)


cfg = RolloutConfig()
model = FrameModel(cfg).eval()
cache = FrameCache(cfg)
with torch.no_grad():
    for t in range(8):
        model(torch.randn(2, cfg.frame_seq_length, cfg.dim), cache)
print(f"fixed={FIXED} frames held: {1 + len(cache.frames)}")
