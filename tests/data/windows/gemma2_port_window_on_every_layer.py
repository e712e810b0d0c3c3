"""A Gemma 2 port whose config names the family and its window, but no layer pattern: the window on every layer.

The config is a plain dict as a port keeps one (`model_type: "gemma2"`, `sliding_window: 4`, 4 layers). Gemma 2's
layers take turns, sliding then full (transformers' configuration_gemma2.py: layer_types "sliding_attention" where
(i + 1) % 2). The slip: the port builds the sliding mask for every layer, so layers 1 and 3 lose their long range.
--fixed applies it on layers 0 and 2 only. SDPA with bool masks, one batch of two unpadded rows of 12 tokens. Prints
the last position's logits' largest gap to a reference whose full layers see every earlier key (0 with --fixed).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

config = {"model_type": "gemma2", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 4,
          "sliding_window": 4, "vocab_size": 50}


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx, self.heads = layer_idx, cfg["num_attention_heads"]
        self.qkv = nn.Linear(cfg["hidden_size"], 3 * cfg["hidden_size"])
        self.o = nn.Linear(cfg["hidden_size"], cfg["hidden_size"])

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, d))


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Attention(cfg, i) for i in range(cfg["num_hidden_layers"]))
        self.head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"])

    def forward(self, ids, windows=None):
        n = ids.shape[1]
        rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
        causal = cols <= rows
        sliding = causal & (rows - cols < self.cfg["sliding_window"])
        x = self.embed(ids)
        for layer in self.layers:
            windowed = (layer.layer_idx % 2 == 0) if FIXED else True
            if windows is not None:
                windowed = windows[layer.layer_idx]
            x = x + layer(x, (sliding if windowed else causal)[None, None])
        return self.head(x)


model = Model(config).eval()
ids = torch.randint(0, config["vocab_size"], (2, 12))
with torch.no_grad():
    logits = model(ids)[:, -1]
    reference = model(ids, windows=[True, False, True, False])[:, -1]
print(f"largest gap to Gemma 2's layers: {float((logits - reference).abs().max()):.2e}")
