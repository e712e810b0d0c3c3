# Correct: a Group-DETR decoder whose config (a dataclass every layer keeps as `self.config`: group_detr, num_queries)
# states its groups, kept apart in training by a block-diagonal additive mask over the G * n queries of one sequence
# (eager softmax), beside an encoder that keeps the same config and attends over all 4 x 4 image tokens (no query groups
# there); then inference, where one group of n queries is decoded with no mask.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class DetrConfig:
    d_model: int = 32
    heads: int = 4
    num_queries: int = 5
    group_detr: int = 3


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.h, self.d = config.heads, config.d_model // config.heads
        self.q, self.k, self.v = (nn.Linear(config.d_model, config.d_model) for _ in range(3))

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.h, self.d).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / self.d**0.5
        if mask is not None:
            scores = scores + mask
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.attn = Attention(config)

    def forward(self, x, mask=None):
        return x + self.attn(x, mask)


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.encoder = nn.ModuleList(Layer(config) for _ in range(2))
        self.decoder = nn.ModuleList(Layer(config) for _ in range(2))
        self.query = nn.Embedding(config.num_queries * config.group_detr, config.d_model)
        self.patch = nn.Conv2d(3, config.d_model, 4, 4)

    def forward(self, images):
        memory = self.patch(images).flatten(2).transpose(1, 2)  # (B, 16, E)
        for layer in self.encoder:
            memory = layer(memory)
        groups = self.config.group_detr if self.training else 1
        n = self.config.num_queries * groups
        tgt = self.query.weight[:n].expand(images.shape[0], -1, -1) + memory.mean(1, keepdim=True)
        group = torch.arange(n) // self.config.num_queries
        mask = torch.zeros(n, n).masked_fill(group[:, None] != group[None, :], float("-inf")) if groups > 1 else None
        for layer in self.decoder:
            tgt = layer(tgt, mask)
        return tgt


torch.manual_seed(0)
model = Model(DetrConfig())
images = torch.randn(2, 3, 16, 16)
model.train()
out = model(images)
out.square().mean().backward()
model.eval()
with torch.no_grad():
    first = model(images)
print(f"{'--fixed' in sys.argv} first group agrees in inference: {(out[:, :5] - first).abs().max().item():.2e}")
