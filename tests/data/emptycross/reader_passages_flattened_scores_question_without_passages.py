# The same bug as d2l-ai/d2l-en#2423 written another way: a retrieval reader whose question tokens attend the passage
# tokens retrieved for it, through a weightless ScaledDotProduct(query, key, value, key_lengths) over (B, H, Lq, Lk)
# scores flattened to one row per (sample, head, query), filled in place with -1e9 past each sample's passage length
# and viewed back before the softmax. Question 1 retrieved no passage (length 0): its rows spread uniform weights
# over the padded passage slots. --fixed: the weights of samples with no passage multiplied by 0 (a bool per sample).
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ScaledDotProduct(nn.Module):
    def forward(self, query, key, value, key_lengths):
        b, h, lq, d = query.shape
        lk = key.shape[-2]
        scores = torch.einsum("bhqd,bhkd->bhqk", query, key) / math.sqrt(d)
        flat = scores.flatten(0, 2)  # (B * H * Lq, Lk)
        lengths = key_lengths.repeat_interleave(h * lq)
        flat[torch.arange(lk)[None, :] >= lengths[:, None]] = -1e9
        weights = flat.view(b, h, lq, lk).softmax(dim=-1)
        if FIXED:
            weights = weights * (key_lengths > 0)[:, None, None, None]
        return weights @ value


class PassageReader(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.attend = ScaledDotProduct()
        self.out = nn.Linear(dim, dim)

    def split(self, x):
        b, n, d = x.shape
        return x.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, question, passages, passage_lengths):
        k, v = self.kv(passages).chunk(2, dim=-1)
        o = self.attend(self.split(self.q(question)), self.split(k), self.split(v), passage_lengths)
        return self.out(o.transpose(1, 2).flatten(2))


reader = PassageReader().eval()
question = torch.randn(3, 5, 16)  # every question token is real
passage_lengths = torch.tensor([9, 0, 4])  # question 1 retrieved nothing
passages = torch.randn(3, 9, 16) * (torch.arange(9)[None, :, None] < passage_lengths[:, None, None])
with torch.no_grad():
    fused = reader(question, passages, passage_lengths)
print("question 1 reads its padded slots:", round(fused[1].abs().max().item(), 4))
