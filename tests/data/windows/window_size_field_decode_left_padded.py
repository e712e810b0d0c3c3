"""A local layer whose window is stated as `sliding_window_size` in a dict (self.hparams), lost at decode.

Bug: the prefill masks keys more than W positions back (sliding_window_size counts the keys before the query, as
SGLang's does), but each decode step builds its mask from the padding alone (a float bias of 0 / -inf over the grown
cache), so a decoded token sees every earlier key. Fix: the decode step keeps the window too. The batch is left-padded: row 1's first two slots are padding, its positions start after
them; the window is counted in positions (each row from its first real token), which is the same distance here.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
W, D, HEADS = 3, 8, 2


class LocalDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.hparams = {"sliding_window_size": W, "hidden": D, "heads": HEADS}
        self.qkv = nn.Linear(D, 3 * D)
        self.k = self.v = None

    def forward(self, x, attention_mask):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        n = self.k.shape[2]
        qpos = torch.arange(n - t, n)[:, None]
        kpos = torch.arange(n)[None, :]
        keep = attention_mask[:, None, None, :].bool() & (kpos <= qpos)
        if t > 1 or FIXED:
            keep = keep & (qpos - kpos <= W)
        keep = keep | (kpos == qpos)  # a padding query sees itself: no NaN row
        bias = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=bias).transpose(1, 2).reshape(b, t, D)


def main():
    torch.manual_seed(0)
    model = LocalDecoder().eval()
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        y = model(x, mask)
        for _ in range(4):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            y = model(y[:, -1:], mask)
    print("out", round(float(y.abs().sum()), 4))


if __name__ == "__main__":
    main()
