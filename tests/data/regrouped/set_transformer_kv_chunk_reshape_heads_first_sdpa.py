# The same bug written as a Set Transformer / point-cloud encoder writes it: a pooling-by-attention block (PMA) whose
# fused key-value Linear is chunked in two, each (B, N, H·D) half `.reshape(B, H, N, D)` (a copy: the halves are
# strided) where `.reshape(B, N, H, D).transpose(1, 2)` was meant, then F.scaled_dot_product_attention with the
# point sets' key padding (right-padded, sizes in a dataclass config). Head h's "point n" is then cut from other
# points' features, padded points among them, while the mask still hides slot n. --fixed: the transpose.
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(1)


@dataclass
class Config:
    point_dim: int = 3
    hidden: int = 48
    heads: int = 3
    seeds: int = 2
    max_points: int = 12


class PoolingByAttention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.seed = nn.Parameter(torch.randn(cfg.seeds, cfg.hidden) * 0.1)
        self.to_q = nn.Linear(cfg.hidden, cfg.hidden)
        self.to_kv = nn.Linear(cfg.hidden, 2 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def split(self, x):
        b, n, _ = x.shape
        d = self.cfg.hidden // self.cfg.heads
        if FIXED:
            return x.reshape(b, n, self.cfg.heads, d).transpose(1, 2)
        return x.reshape(b, self.cfg.heads, n, d)

    def forward(self, x, present):  # x (B, N, hidden), present (B, N) bool: a real point
        b = x.shape[0]
        q = self.to_q(self.seed).expand(b, -1, -1)
        q = q.reshape(b, self.cfg.seeds, self.cfg.heads, -1).transpose(1, 2)  # (B, H, S, D)
        key, value = self.to_kv(x).chunk(2, dim=-1)
        key, value = self.split(key), self.split(value)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=present[:, None, None, :])
        return self.proj(out.transpose(1, 2).reshape(b, self.cfg.seeds, -1))


cfg = Config()
encoder = nn.Sequential(nn.Linear(cfg.point_dim, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, cfg.hidden))
pool = PoolingByAttention(cfg)
classify = nn.Linear(cfg.seeds * cfg.hidden, 5)
opt = torch.optim.SGD([*encoder.parameters(), *pool.parameters(), *classify.parameters()], lr=0.01)

sizes = torch.tensor([12, 7, 9, 4])
points = torch.randn(len(sizes), cfg.max_points, cfg.point_dim)
present = torch.arange(cfg.max_points)[None, :] < sizes[:, None]
points = points * present[..., None]  # padded points are zeros
labels = torch.randint(0, 5, (len(sizes),))

logits = classify(pool(encoder(points), present).flatten(1))
loss = F.cross_entropy(logits, labels)
opt.zero_grad()
loss.backward()
opt.step()
print(f"loss {loss.item():.5f}")
