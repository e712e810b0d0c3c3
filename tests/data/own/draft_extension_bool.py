"""A draft head trained with test-time steps (EAGLE style) on a causal batch of two rows: each step attends to every
earlier step's keys, its mask the previous one with a block for the new keys cat-ed on; the block is all True, so a
query sees every later position's draft; --fixed: only its own position's draft (the diagonal)."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class DraftLayer(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * dim)

    def forward(self, x, keys, values, mask):
        k, v = self.kv(x).chunk(2, dim=-1)
        keys, values = torch.cat([keys, k[:, None]], dim=2), torch.cat([values, v[:, None]], dim=2)
        out = F.scaled_dot_product_attention(self.q(x)[:, None], keys, values, attn_mask=mask)
        return out[:, 0], keys, values


class Drafter(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.layer = DraftLayer(dim)

    def forward(self, hidden, steps=3):
        b, t, d = hidden.shape
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None].expand(b, 1, t, t)
        keys = values = hidden.new_zeros(b, 1, 0, d)
        for _ in range(steps):
            hidden, keys, values = self.layer(hidden, keys, values, mask)
            block = torch.eye(t, dtype=torch.bool) if FIXED else torch.ones(t, t, dtype=torch.bool)
            mask = torch.cat([mask, block[None, None].expand(b, 1, t, t)], dim=-1)
        return hidden


if __name__ == "__main__":
    torch.manual_seed(0)
    with torch.no_grad():
        out = Drafter().eval()(torch.randn(2, 6, 8))
    print("drafts", tuple(out.shape))
