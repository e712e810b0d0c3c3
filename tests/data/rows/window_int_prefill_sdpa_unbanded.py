"""A right-padded batch through SDPA, `attend` holding a plain int sliding_window = 4 beside kv_len: the prefill
branch builds causality and padding only, the decode branch the band (--fixed: the band in both).

Written for maskcli's tests (checks/handed.py's window-dropped on a plain int window): the model keeps the window as
`self.w` (no field name a config reader knows), boolean masks, two batch rows of lengths 9 and 6 (right padding), a
prefill then one decode step per row.
"""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def attend(q, k, v, real_keys, sliding_window, kv_len):
    """SDPA of q over the first kv_len keys; real_keys: bool (B, kv_len), True on a real token."""
    q_len = q.shape[2]
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    allowed = k_pos <= q_pos
    if FIXED or q_len == 1:
        allowed = allowed & (q_pos - k_pos < sliding_window)
    mask = allowed[None, None] & real_keys[:, None, None, :]
    return F.scaled_dot_product_attention(q, k[:, :, :kv_len], v[:, :, :kv_len], attn_mask=mask)


class LocalModel(torch.nn.Module):
    def __init__(self, window):
        super().__init__()
        self.w = window
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x, real_keys, cache):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        start = cache["len"]
        cache["k"][:, :, start:start + t] = k
        cache["v"][:, :, start:start + t] = v
        cache["len"] = start + t
        return attend(q, cache["k"], cache["v"], real_keys, self.w, start + t)


def main():
    torch.manual_seed(0)
    model = LocalModel(4)
    lengths = torch.tensor([9, 6])
    real = torch.arange(9)[None, :] < lengths[:, None]
    cache = {"k": torch.zeros(2, 2, 10, 8), "v": torch.zeros(2, 2, 10, 8), "len": 0}
    with torch.no_grad():
        out = model(torch.randn(2, 9, 16), real, cache)
        real = torch.cat([real, torch.ones(2, 1, dtype=torch.bool)], dim=1)
        out = model(torch.randn(2, 1, 16), real, cache)
    print("fixed" if FIXED else "buggy", out.shape)


if __name__ == "__main__":
    main()
