"""A bidirectional local encoder whose sliding layers OR a causal window with the half-window band: lopsided.

Bug: the config (a dict at the top of the program: sliding_window=6, is_causal=False, layer_types sliding / full)
states a window both ways; the sliding layers build `(k <= q) & (k > q - W)` OR `|q - k| <= W // 2`, so each token
sees W - 1 = 5 keys behind and W // 2 = 3 ahead (as transformers#40700's EmbeddingGemma overlay did). Fix: the band
alone, `|q - k| <= W // 2`. A left-padded batch of two (its attention_mask), SDPA with a bool mask.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv

hf_config = {"hidden_size": 16, "num_attention_heads": 2, "sliding_window": 6, "is_causal": False,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg["num_attention_heads"]
        self.qkv = nn.Linear(cfg["hidden_size"], 3 * cfg["hidden_size"])
        self.out = nn.Linear(cfg["hidden_size"], cfg["hidden_size"])

    def forward(self, x, keep):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        return x + self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, t, d))


class Encoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([Layer(cfg) for _ in cfg["layer_types"]])

    def forward(self, x, attention_mask):
        t = x.shape[1]
        pos = torch.arange(t)
        rel = pos[:, None] - pos[None, :]
        half = self.cfg["sliding_window"] // 2
        band = rel.abs() <= half
        if not FIXED:
            band = band | ((rel >= 0) & (rel < self.cfg["sliding_window"]))
        pad = attention_mask[:, None, None, :].bool()
        masks = {"sliding_attention": band[None, None] & pad, "full_attention": pad.expand(-1, 1, t, -1)}
        for kind, layer in zip(self.cfg["layer_types"], self.layers):
            x = layer(x, masks[kind])
        return x


def main():
    torch.manual_seed(0)
    model = Encoder(hf_config).eval()
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        out = model(torch.randn(2, 14, 16), mask)
    print("pooled", round(float((out * mask[..., None]).sum(1).norm()), 4))


if __name__ == "__main__":
    main()
