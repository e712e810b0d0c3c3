# Written another way (the bug of lucidrains/perceiver-pytorch c8c5f57): a latent resampler over a left-padded batch of
# media tokens, its config a dataclass, nn.MultiheadAttention with key_padding_mask (True = padding). Token dropout keeps
# round((1 - token_drop) * n) slots of every row, the padding ranked last: a short row keeps all of its real tokens.
# The fix keeps ceil(len * (1 - token_drop)) of each row's own real tokens (the other slots marked padding).
import math
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class ResamplerConfig:
    dim: int = 32
    heads: int = 4
    num_latents: int = 6
    token_drop: float = 0.25


class Resampler(nn.Module):
    def __init__(self, cfg: ResamplerConfig):
        super().__init__()
        self.cfg = cfg
        self.latents = nn.Parameter(torch.randn(cfg.num_latents, cfg.dim))
        self.norm = nn.LayerNorm(cfg.dim)
        self.attn = nn.MultiheadAttention(cfg.dim, cfg.heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(cfg.dim, 2 * cfg.dim), nn.GELU(), nn.Linear(2 * cfg.dim, cfg.dim))

    def drop_tokens(self, media, key_padding_mask):
        b, n, _ = media.shape
        keep = 1.0 - self.cfg.token_drop
        slots = max(1, round(n * keep))
        noise = torch.rand(b, n).masked_fill(key_padding_mask, -1.0)  # padding ranked last
        order = noise.argsort(dim=1, descending=True)[:, :slots]
        rows = torch.arange(b)[:, None]
        media, pad = media[rows, order], key_padding_mask[rows, order]
        if FIXED:
            real = (~key_padding_mask).sum(dim=1)
            quota = torch.ceil(real * keep).long()
            pad = pad | (torch.arange(slots)[None, :] >= quota[:, None])
        return media, pad

    def forward(self, media, key_padding_mask):
        if self.training and self.cfg.token_drop > 0:
            media, key_padding_mask = self.drop_tokens(media, key_padding_mask)
        x = self.latents[None].expand(media.shape[0], -1, -1)
        kv = self.norm(media)
        x = x + self.attn(x, kv, kv, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return x + self.ff(x)


cfg = ResamplerConfig()
model = Resampler(cfg).train()
n = 16
lengths = torch.tensor([16, 5, 10])
media = torch.randn(3, n, cfg.dim)
key_padding_mask = torch.arange(n)[None, :] < (n - lengths)[:, None]  # left padding: True on the leading pads

seen = {}
model.attn.register_forward_pre_hook(lambda m, a, k: seen.update(pad=k["key_padding_mask"]), with_kwargs=True)
out = model(media, key_padding_mask)
out.pow(2).mean().backward()
kept = (~seen["pad"]).sum(dim=1)
share = [math.ceil(int(x) * (1 - cfg.token_drop)) for x in lengths]
print(f"fixed={FIXED} real tokens kept per row: {kept.tolist()} (the token_drop share: {share})")
