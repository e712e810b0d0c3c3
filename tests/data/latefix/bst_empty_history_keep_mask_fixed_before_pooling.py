# The same bug as FuxiCTR 3a060ba (TransAct's adjust_mask after the encoder), written another way: a Behavior
# Sequence Transformer block over right-padded histories with F.scaled_dot_product_attention and a bool keep-mask
# (True = a real behavior). A user with no history has a row of keys all False; the model makes sure each row keeps
# one slot (`ensure_one_slot`, in place on the same tensor), but only before its masked mean pooling, after the
# attention already ran with the empty row: that user's attention output is zero and the target item it carries is
# lost. The fix calls ensure_one_slot before the attention.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def ensure_one_slot(attention_mask):
    """Keep the first slot of rows with no real behavior, in place, so that no row is empty."""
    empty = ~attention_mask.any(dim=-1)
    attention_mask[empty, 0] = True
    return attention_mask


class BSTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, behaviors, attention_mask):
        if FIXED:
            ensure_one_slot(attention_mask)
        b, n, d = behaviors.shape
        q, k, v = self.qkv(behaviors).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        keys = attention_mask[:, None, None, :]  # (B, 1, 1, N): a real behavior is a key
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
        x = self.out(x.transpose(1, 2).reshape(b, n, d))
        if not FIXED:
            ensure_one_slot(attention_mask)  # (too late: only the pooling below reads it)
        weights = attention_mask.float().unsqueeze(-1)
        return (x * weights).sum(1) / weights.sum(1)


dim, slots = 8, 5
target = torch.randn(3, dim)
behaviors = torch.randn(3, slots, dim) + target[:, None, :]  # each slot carries the target item (as BST concatenates it)
attention_mask = torch.tensor([[True, True, True, False, False],
                               [False, False, False, False, False],  # a new user: no behavior yet
                               [True, True, True, True, True]])
block = BSTBlock(dim, heads=2).eval()
with torch.no_grad():
    pooled = block(behaviors, attention_mask)
print("|pooled| per user:", [round(v, 5) for v in pooled.abs().sum(-1).tolist()])
