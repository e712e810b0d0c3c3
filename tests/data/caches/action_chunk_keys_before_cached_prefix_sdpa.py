"""A policy head that caches a right-padded observation prefix once, then runs a bidirectional action chunk whose
keys are its own followed by the cached prefix's (torch.cat([new, cached])), through SDPA with an additive mask (finfo.min)
that folds the prefix's padding in. Correct: the padding is held at the columns after the chunk's own.

`--lost` drops the prefix padding at the chunk steps (the mask all True): the padding the prefill masked is seen."""
import sys

import torch
import torch.nn.functional as F
from torch import nn

LOST = "--lost" in sys.argv


class Block(nn.Module):
    def __init__(self, width=32, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x, keep, cache=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if cache is None:
            cache = (k, v)
            keys, values = k, v
        else:
            keys, values = torch.cat([k, cache[0]], dim=2), torch.cat([v, cache[1]], dim=2)
        bias = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias[:, None])
        return self.out(y.transpose(1, 2).reshape(b, n, -1)), cache


def main():
    torch.manual_seed(0)
    block = Block().eval()
    lengths = torch.tensor([5, 9])
    prefix_len, chunk = 9, 4
    real = torch.arange(prefix_len)[None, :] < lengths[:, None]  # (B, P): right-padded observations
    obs = torch.randn(2, prefix_len, 32)
    prefix_keep = real[:, None, :] & real[:, :, None]
    with torch.no_grad():
        _, cache = block(obs, prefix_keep)
        actions = torch.randn(2, chunk, 32)
        for _ in range(3):
            own = torch.ones(2, chunk, chunk, dtype=torch.bool)
            onto = real[:, None, :].expand(2, chunk, prefix_len)
            if LOST:
                onto = torch.ones_like(onto)
            step_keep = torch.cat([own, onto], dim=2)
            velocity, _ = block(actions, step_keep, cache)
            actions = actions - 0.25 * velocity
    print(actions.norm().item())


if __name__ == "__main__":
    main()
