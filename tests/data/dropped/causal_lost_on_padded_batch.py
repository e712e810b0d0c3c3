"""A causal embedding model whose config (a dataclass held as `self.config`) says `use_bidirectional_attention=False`:
a lone text goes to SDPA with is_causal=True, but a right-padded batch is handed its padding mask alone, so the
same layers attend both ways there; --fixed: the padding mask and-ed with the causal triangle."""

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class EmbedConfig:
    hidden_size: int = 16
    num_attention_heads: int = 2
    num_hidden_layers: int = 2
    use_bidirectional_attention: bool = False


class Layer(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        self.qkv = torch.nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if keep is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return x + out.transpose(1, 2).reshape(b, n, d)


class Embedder(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x, attention_mask=None):
        keep = None
        if attention_mask is not None:
            keep = attention_mask[:, None, None, :].bool()
            if FIXED:
                n = x.shape[1]
                keep = keep & torch.ones(n, n, dtype=torch.bool).tril()
        for layer in self.layers:
            x = layer(x, keep)
        return x[:, -1]


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Embedder(EmbedConfig()).eval()
    with torch.no_grad():
        print(model(torch.randn(1, 5, 16)).shape)
        mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
        print(model(torch.randn(2, 5, 16), attention_mask=mask).shape)
