# jax#32300 written another way: a torch attention helper that takes jax's `local_window_size` ((left, right), or an
# int both ways) and builds its window only on the branch where a mask is also given; an encoder calling it with
# mask=None and local_window_size=3 gets full attention through SDPA. --fixed: the window is built on every branch.
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def attend(q, k, v, mask=None, local_window_size=None):
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)
    if mask is None and (not FIXED or local_window_size is None):
        return F.scaled_dot_product_attention(q, k, v)
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool) if mask is None else mask
    if local_window_size is not None:
        left, right = local_window_size
        i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
        keep = keep & (j >= i - left) & (j <= i + right)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


torch.manual_seed(0)
x = torch.randn(2, 4, 12, 8)
for _ in range(2):
    x = x + attend(x, x, x, local_window_size=3)
print(f"{x.abs().mean().item():.6f}")
