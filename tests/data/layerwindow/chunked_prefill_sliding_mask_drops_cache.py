"""A hybrid model (a config's `layer_types`: sliding then full, `sliding_window = 6`) over a static cache, its prompt
prefilled in chunks of 4. The full layers' mask is causal over the cache's positions; the sliding layers' mask is built
per chunk. Buggy: it is built over the chunk's own keys only (`i - j < W` inside the chunk), so a second chunk's query
sees none of the cached keys its window holds; fixed: over the absolute positions, the cached ones within the window
included. Written after pytorch/executorch#14411 (the QNN runner's sliding-window mask rows never updated to see the
cache) in another style: a config dataclass, SDPA with bool masks over a static cache, two prompts at once."""
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class HybridConfig:
    hidden_size: int = 16
    num_attention_heads: int = 2
    vocab_size: int = 30
    max_cache_len: int = 16
    sliding_window: int = 6
    layer_types: list = field(default_factory=lambda: ["sliding_attention", "full_attention"])


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.heads, self.dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
        self.qkv, self.o = nn.Linear(config.hidden_size, 3 * config.hidden_size), nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_idx = layer_idx
        self.register_buffer("k", torch.zeros(2, self.heads, config.max_cache_len, self.dim))
        self.register_buffer("v", torch.zeros(2, self.heads, config.max_cache_len, self.dim))

    def forward(self, x, cache_position, mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
        self.k[:, :, cache_position] = k
        self.v[:, :, cache_position] = v
        y = F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(b, n, -1))


class HybridModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Attention(config, i) for i in range(len(config.layer_types))])

    def masks(self, cache_position):
        slots = torch.arange(self.config.max_cache_len)
        pos = cache_position[:, None]
        causal = slots[None, :] <= pos
        if FIXED:
            sliding = causal & (pos - slots[None, :] < self.config.sliding_window)
        else:  # the window laid over the chunk's own keys: cached slots before the chunk never seen
            first = int(cache_position[0])
            sliding = causal & (slots[None, :] >= first) & (pos - slots[None, :] < self.config.sliding_window)
        return {"full_attention": causal[None, None], "sliding_attention": sliding[None, None]}

    def forward(self, input_ids, cache_position):
        x = self.embed(input_ids)
        masks = self.masks(cache_position)
        for layer, kind in zip(self.layers, self.config.layer_types):
            x = x + layer(x, cache_position, masks[kind])
        return x


model = HybridModel(HybridConfig()).eval()
prompt = torch.randint(0, 30, (2, 12))
with torch.no_grad():
    for start in range(0, 12, 4):
        model(prompt[:, start:start + 4], torch.arange(start, start + 4))
