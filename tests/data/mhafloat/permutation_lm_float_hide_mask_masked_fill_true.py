# Written another way (the bug of parseq 056c792's generate_attn_masks, a float zeros mask filled with True): an
# XLNet-style permutation language model on a hand-written SDPA decoder, over a left-padded batch. Each permutation's
# "may not attend" mask is allocated as float zeros and filled with `masked_fill(later, True)`: SDPA adds a float
# mask, so +1.0 lands on the keys a query must not see and every query reads the characters it is asked to predict.
# The fix fills -inf (a float additive mask).
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

VOCAB, PAD, D, H = 16, 0, 32, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x, bias):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return x + self.proj(y.transpose(1, 2).reshape(B, T, D))


class PermutationLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(D, VOCAB)

    @staticmethod
    def hide_mask(order, pad):
        """(B, 1, T, T): a query may not see the keys that come after it in the factorisation order, nor padding."""
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))
        later = rank[:, None, :] > rank[:, :, None]  # key after query in the order
        hidden = later | pad[:, None, :]
        hidden = hidden & ~torch.eye(order.shape[1], dtype=torch.bool)  # (a query sees itself)
        mask = torch.zeros(hidden.shape)
        mask = mask.masked_fill(hidden, float("-inf") if FIXED else True)
        return mask[:, None]

    def forward(self, ids, order):
        pad = ids == PAD
        x = self.embed(ids)
        bias = self.hide_mask(order, pad)
        for block in self.blocks:
            x = block(x, bias)
        return self.head(x)


model = PermutationLM().eval()
ids = torch.tensor([[PAD, PAD, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
order = torch.stack([torch.tensor([0, 1, 5, 4, 3, 2]), torch.tensor([3, 1, 0, 5, 2, 4])])
with torch.no_grad():
    logits = model(ids, order)
print(f"logits {tuple(logits.shape)}, mean {logits.mean().item():.4f}")
