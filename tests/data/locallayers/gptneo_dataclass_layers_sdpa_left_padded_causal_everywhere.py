# GPT-Neo's local layers given the global causal mask, written as a small nn.Module port: the config is a dataclass
# that lists every layer's kind (`attention_layers`, GPT-Neo's expanded form) and `window_size`, each block keeps it
# as `self.config`, the layers sit in a ModuleList (their number is the module path's), the batch is left-padded, the
# kernel is F.scaled_dot_product_attention with a bool keep-mask, and decoding appends to a growing KV cache. The
# port builds one causal & padding mask per forward and hands it to every block; the fix cuts it to the last
# window_size keys on the blocks whose kind is "local".
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class NeoConfig:
    vocab_size: int = 50
    hidden_size: int = 32
    num_heads: int = 2
    window_size: int = 3
    attention_layers: list = field(default_factory=lambda: ["global", "local", "local", "global"])
    pad_token_id: int = 0


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h, self.d = config.num_heads, config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, keep, cache):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.h, self.d).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])
        return self.out(o.transpose(1, 2).reshape(b, n, -1)), (k, v)


class Block(nn.Module):
    def __init__(self, config, kind):
        super().__init__()
        self.config, self.kind = config, kind
        self.ln1, self.ln2 = nn.LayerNorm(config.hidden_size), nn.LayerNorm(config.hidden_size)
        self.attn = Attention(config)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.GELU(), nn.Linear(64, config.hidden_size))

    def forward(self, x, keep, positions, key_positions, cache=None):
        if FIXED and self.kind == "local":
            keep = keep & (key_positions[:, None, :] > positions[:, :, None] - self.config.window_size)
        a, cache = self.attn(self.ln1(x), keep, cache)
        x = x + a
        return x + self.mlp(self.ln2(x)), cache


class NeoModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(64, config.hidden_size)
        self.h = nn.ModuleList(Block(config, kind) for kind in config.attention_layers)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, attention_mask, caches=None):
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
        key_positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        real = attention_mask.bool()
        keep = (key_positions[:, None, :] <= positions[:, :, None]) & real[:, None, :]
        x = self.wte(input_ids) + self.wpe(positions)
        caches = caches or [None] * len(self.h)
        new = []
        for block, cache in zip(self.h, caches):
            x, c = block(x, keep, positions, key_positions, cache)
            new.append(c)
        return self.head(x), new


config = NeoConfig()
model = NeoModel(config).eval()
ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17]])  # left-padded with pad_token_id 0
mask = (ids != config.pad_token_id).long()
with torch.no_grad():
    logits, caches = model(ids, mask)
    out = []
    for _ in range(3):
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        logits, caches = model(token, mask, caches)
print(torch.cat(out, 1).tolist())
