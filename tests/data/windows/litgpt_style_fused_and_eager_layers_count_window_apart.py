# Written another way than AI-Hypercomputer/maxtext#4289: a LitGPT-style model whose `self.config` (a dataclass)
# states `sliding_window_size`, the keys each query keeps with itself; its layers alternate a "fused" path, whose
# band mask is built with `triu(diagonal=-sliding_window_size)` (one key more than the config says), and an eager path
# that keeps `sliding_window_size` keys. The batch is left-padded with its attention_mask. --fixed builds the fused
# band with `-(sliding_window_size - 1)`.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class ModelArgs:
    vocab_size: int = 50
    n_embd: int = 32
    n_head: int = 4
    n_layer: int = 2
    sliding_window_size: int = 3
    attention_type: str = "local_sliding"


def band(n, lower):
    """Bool (n, n), True = attend: causal and at most `lower` positions back."""
    return torch.ones(n, n, dtype=torch.bool).tril().triu(diagonal=-lower)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, fused):
        super().__init__()
        self.config, self.fused = config, fused
        self.attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x, padding):
        b, t, c = x.shape
        h = self.config.n_head
        q, k, v = self.attn(x).view(b, t, 3, h, c // h).permute(2, 0, 3, 1, 4)
        w = self.config.sliding_window_size
        real = padding.bool()[:, None, None, :]
        if self.fused:
            mask = band(t, w - 1 if FIXED else w)[None, None] & real
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            scores = q @ k.transpose(-1, -2) / (c // h) ** 0.5
            mask = band(t, w - 1)[None, None] & real
            y = scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList(CausalSelfAttention(config, fused=i % 2 == 0) for i in range(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size)

    def forward(self, idx, attention_mask):
        x = self.wte(idx)
        for block in self.h:
            x = x + block(x, attention_mask)
        return self.lm_head(x)


def main():
    torch.manual_seed(0)
    model = GPT(ModelArgs()).eval()
    idx = torch.randint(1, 50, (2, 10))
    attention_mask = torch.ones(2, 10, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding
    idx[1, :3] = 0
    with torch.no_grad():
        logits = model(idx, attention_mask=attention_mask)
    print(f"logits norm: {logits.norm().item():.4f}")


if __name__ == "__main__":
    main()
