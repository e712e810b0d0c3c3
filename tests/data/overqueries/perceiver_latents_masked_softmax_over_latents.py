# The bug of pyg-team/pytorch_geometric#6343 written as a Perceiver-style set encoder writes it (lucidrains' einsum
# style, a config dataclass, left-padded inputs): learned latents cross-attend a padded batch of inputs; the input
# padding mask is written into the (b, h, latents, inputs) scores with masked_fill, the same fill in every latent's
# row, and the softmax is taken over dim -2, the latents, so the fill cancels and each latent pools the padded inputs.
# --fixed: the softmax over the inputs (dim -1), where the fill hides the padding.
import sys
from dataclasses import dataclass

import torch
from torch import einsum, nn

FIXED = "--fixed" in sys.argv


@dataclass
class PerceiverConfig:
    dim: int = 32
    num_latents: int = 4
    latent_dim: int = 32
    cross_heads: int = 2
    cross_dim_head: int = 16


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim, heads, dim_head):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale = heads, dim_head ** -0.5
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_kv = nn.Linear(context_dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, query_dim)

    def forward(self, x, context, mask=None):
        b, n, _ = x.shape
        h = self.heads
        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        q, k, v = (t.reshape(b, t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))
        sim = einsum("bhid,bhjd->bhij", q, k) * self.scale
        if mask is not None:
            sim = sim.masked_fill(~mask[:, None, None, :], -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1) if FIXED else sim.softmax(dim=-2)
        out = einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class PerceiverPool(nn.Module):
    def __init__(self, config: PerceiverConfig):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(config.num_latents, config.latent_dim))
        self.cross = CrossAttention(config.latent_dim, config.dim, config.cross_heads, config.cross_dim_head)
        self.norm = nn.LayerNorm(config.latent_dim)

    def forward(self, data, mask):
        x = self.latents.unsqueeze(0).expand(data.shape[0], -1, -1)
        x = x + self.cross(self.norm(x), data, mask=mask)
        return x.mean(dim=1)


def left_pad(seqs, dim):
    longest = max(len(s) for s in seqs)
    data = torch.zeros(len(seqs), longest, dim)
    mask = torch.zeros(len(seqs), longest, dtype=torch.bool)
    for i, s in enumerate(seqs):
        data[i, longest - len(s):] = s
        mask[i, longest - len(s):] = True
    return data, mask


torch.manual_seed(0)
config = PerceiverConfig()
model = PerceiverPool(config)
lengths = [9, 6, 3]
data, mask = left_pad([torch.randn(n, config.dim) for n in lengths], config.dim)
with torch.no_grad():
    pooled = model(data, mask)
print(pooled.shape)
