"""Streaming-encoder chunk attention: each frame sees its own chunk and the one before (num_left_chunks=1).

The config (a SimpleNamespace) states attention_chunk_size=4 beside num_left_chunks=1: the chunk is the block a
local window is computed in, not a boundary no frame sees across (as Gemma 4's audio tower states its chunks with
attention_context_left). A right-padded batch of 12 frames (lengths 12 and 9), the mask built as an additive bias
over absolute frames, one SDPA call per layer. Correct: nothing contradicts the config.
"""
from types import SimpleNamespace

import torch
import torch.nn.functional as F

cfg = SimpleNamespace(hidden_size=8, num_attention_heads=2, attention_chunk_size=4, num_left_chunks=1)


class Encoder(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.qkv = torch.nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, x, lengths):
        b, t, d = x.shape
        h = self.config.num_attention_heads
        size, left = self.config.attention_chunk_size, self.config.num_left_chunks
        frame = torch.arange(t)[None, :].expand(b, t)
        chunk = torch.div(frame, size, rounding_mode="floor")
        allowed = (chunk[:, None, :] <= chunk[:, :, None]) & (chunk[:, None, :] >= chunk[:, :, None] - left)
        allowed &= (frame < lengths[:, None])[:, None, :]
        allowed |= torch.eye(t, dtype=torch.bool)[None]  # (a padded frame sees itself: no empty row)
        bias = torch.zeros(b, 1, t, t).masked_fill(~allowed[:, None], float("-inf"))
        q, k, v = self.qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, t, d)


torch.manual_seed(0)
model = Encoder(cfg).eval()
with torch.no_grad():
    out = model(torch.randn(2, 12, cfg.hidden_size), torch.tensor([12, 9]))
print("out", tuple(out.shape), round(out.abs().mean().item(), 4))
