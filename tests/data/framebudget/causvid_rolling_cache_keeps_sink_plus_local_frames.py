# Written another way than FastVideo dad62979e (tests/data/bugs/fastvideo_block_causal_sink_rolling_window_one_frame_too_wide.py):
# a CausVid / Self-Forcing style autoregressive video generator, frame by frame over a batch of two clips, with a
# rolling KV cache of its own (a list of frames' K/V) and the config in a dict the model holds (self.config). The
# cache should keep local_attn_size frames, the sink frames among them; the buggy eviction keeps the sink frames
# plus local_attn_size more, so each query reads a frame the model's budget says is gone. SDPA gets no mask: the
# keys handed over are the whole cache.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class CausalFrameAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q, self.kv, self.o = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)

    def forward(self, x, cache, config):
        B, N, C = x.shape
        q = self.q(x).view(B, N, self.heads, -1).transpose(1, 2)
        k, v = self.kv(x).view(B, N, 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        cache.append((k, v))  # this frame's K/V, written before it attends
        sink, local = config["sink_size"], config["local_attn_size"]
        kept = local if not FIXED else local - sink  # frames past the sink the cache keeps
        while len(cache) > sink + kept:
            del cache[sink]  # evict the oldest frame after the sink frames
        keys = torch.cat([kv[0] for kv in cache], dim=2)
        values = torch.cat([kv[1] for kv in cache], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values)
        return self.o(out.transpose(1, 2).reshape(B, N, C))


class CausalVideoGenerator(nn.Module):
    def __init__(self, dim=16, heads=2, layers=2):
        super().__init__()
        self.config = {"local_attn_size": 3, "sink_size": 1, "frame_seq_length": 4, "num_frame_per_block": 1}
        self.layers = nn.ModuleList([CausalFrameAttention(dim, heads) for _ in range(layers)])
        self.head = nn.Linear(dim, dim)

    def forward(self, frame, caches):
        h = frame
        for layer, cache in zip(self.layers, caches):
            h = h + layer(h, cache, self.config)
        return self.head(h)


model = CausalVideoGenerator().eval()
caches = [[] for _ in model.layers]
frame = torch.randn(2, model.config["frame_seq_length"], 16)  # two clips, one frame of 4 tokens each
with torch.no_grad():
    for step in range(6):
        frame = model(frame, caches)
print("cached frames per layer:", [len(c) for c in caches], "last frame mean", frame.mean().item())
