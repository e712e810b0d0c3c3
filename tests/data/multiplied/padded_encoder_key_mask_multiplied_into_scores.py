# Written another way (checks/multiplied.py): a text encoder over a right-padded batch whose attention multiplies the
# key padding mask (1 = real token, 0 = padding) into the scores before the softmax, as the shifted-window masks of
# berniwal/swin-transformer-pytorch (ae5ae7b) were multiplied into the window logits: the padded keys get logit 0,
# not -inf, and every real query still weighs them. The fix fills the padded keys' scores with -inf.
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        key_keep = keep[:, None, None, :]  # (B, 1, 1, Lk): 1 where the key is a real token
        if FIXED:
            scores = scores.masked_fill(key_keep == 0, float("-inf"))
        else:
            scores = torch.mul(scores, key_keep.to(scores.dtype))
        weights = scores.softmax(dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, d))


class Encoder(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.attn = nn.ModuleList(SelfAttention(dim, heads) for _ in range(layers))
        self.norm = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keep = (ids != 0).long()
        h = self.embed(ids)
        for attn, norm in zip(self.attn, self.norm):
            h = h + attn(norm(h), keep)
        return h


ids = torch.tensor([[5, 8, 13, 21, 34, 3], [7, 11, 2, 0, 0, 0], [9, 4, 0, 0, 0, 0]])  # right-padded with 0
model = Encoder().eval()
with torch.no_grad():
    full = model(ids)
    alone = model(ids[1:2, :3])  # row 1's real tokens on their own: what the padded batch should give them
print(f"row 1 in the padded batch vs alone: max |diff| = {(full[1, :3] - alone[0]).abs().max().item():.6f}")
