"""An embedding model whose config (a dataclass on `self.config`) states is_causal=False, run on a right-padded batch
through the decoder's attention it was ported from (a causal triangle and-ed on its padding mask); --fixed: the
padding mask alone."""

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class EmbedderConfig:
    hidden_size: int = 8
    num_hidden_layers: int = 2
    is_causal: bool = False


class Attention(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.proj = torch.nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.causal = not FIXED

    def forward(self, x, padding):
        q, k, v = self.proj(x).unsqueeze(1).chunk(3, dim=-1)
        keep = padding[:, None, None, :].bool()
        if self.causal:
            keep = keep & torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep).squeeze(1)


class Embedder(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList(Attention(config) for _ in range(config.num_hidden_layers))

    def forward(self, x, attention_mask):
        for layer in self.layers:
            x = x + layer(x, attention_mask)
        kept = attention_mask[..., None].to(x.dtype)
        return (x * kept).sum(1) / kept.sum(1)  # (the real tokens' mean)


torch.manual_seed(0)
with torch.no_grad():
    Embedder(EmbedderConfig())(torch.randn(2, 6, 8), attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6]))
