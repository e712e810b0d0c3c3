# The same bug as ModelTC/LightX2V#1008 (commit 90457e8), written another way: a LongLive-style causal video block
# keeps its own rolling KV cache as buffers laid (B, L, H, D), its sink frames at the front. The cache is sized for
# the sink *plus* local_attn_size frames while the attention slice takes the last local_attn_size frames, so once the
# buffer fills the slice starts right past the sink and no query sees the sink frames. Batch of 2, keys handed to SDPA
# as a (B, L, H, D) slice turned to (B, H, L, D). The fix sizes the buffer local_attn_size frames (the sink among
# them), so the window is the whole buffer and the roll keeps the sink in front.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

DIM, HEADS = 16, 2
HEAD_DIM = DIM // HEADS


class SinkCachedAttention(nn.Module):
    def __init__(self, batch, local_attn_size=3, sink_size=1, frame_seqlen=3):
        super().__init__()
        self.local_attn_size, self.sink_size, self.frame_seqlen = local_attn_size, sink_size, frame_seqlen
        self.window_tokens = local_attn_size * frame_seqlen
        frames = local_attn_size if FIXED else local_attn_size + sink_size
        self.register_buffer("k_cache", torch.zeros(batch, frames * frame_seqlen, HEADS, HEAD_DIM), persistent=False)
        self.register_buffer("v_cache", torch.zeros(batch, frames * frame_seqlen, HEADS, HEAD_DIM), persistent=False)
        self.filled = 0
        self.to_q, self.to_k, self.to_v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = (f(x).view(B, L, HEADS, HEAD_DIM) for f in (self.to_q, self.to_k, self.to_v))
        size, sink = self.k_cache.shape[1], self.sink_size * self.frame_seqlen
        if self.filled + L > size:  # evict the oldest frames after the sink, roll the rest to the front
            evict = self.filled + L - size
            for cache in (self.k_cache, self.v_cache):
                cache[:, sink:self.filled - evict] = cache[:, sink + evict:self.filled].clone()
            self.filled -= evict
        self.k_cache[:, self.filled:self.filled + L] = k
        self.v_cache[:, self.filled:self.filled + L] = v
        self.filled += L
        start = max(0, self.filled - self.window_tokens)
        keys = self.k_cache[:, start:self.filled].transpose(1, 2)
        values = self.v_cache[:, start:self.filled].transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values)
        return out.transpose(1, 2).reshape(B, L, DIM)


class CausalVideoModel(nn.Module):
    def __init__(self, batch):
        super().__init__()
        self.blocks = nn.ModuleList([SinkCachedAttention(batch) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


model = CausalVideoModel(batch=2)
with torch.no_grad():
    frames = [model(torch.randn(2, 3, DIM)) for _ in range(7)]  # one frame (3 tokens) a step
print(f"cache slots {model.blocks[0].k_cache.shape[1]}, window {model.blocks[0].window_tokens}")
