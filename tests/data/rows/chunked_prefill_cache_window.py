"""A plain-torch chunked prefill of a sliding-window layer (no config: the first chunk shows the window): the later
chunks' mask is the window over the chunk's keys plus every cached key of the last W (--fixed: each query's own W)."""
import sys
import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
W, CHUNK, N = 4, 6, 18
torch.manual_seed(0)
x = torch.randn(1, 2, N, 8)
for start in range(0, N, CHUNK):
    q = x[:, :, start:start + CHUNK]
    k = x[:, :, :start + CHUNK]
    qp = torch.arange(start, start + CHUNK)[:, None]
    kp = torch.arange(start + CHUNK)[None, :]
    own = (kp <= qp) & (qp - kp < W)
    if not FIXED:
        own |= (kp < start) & (start - kp < W)  # "the cache's last W keys are in every query's window"
    F.scaled_dot_product_attention(q, k, k, attn_mask=own)
