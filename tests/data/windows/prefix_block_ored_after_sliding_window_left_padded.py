"""A hand-written PaliGemma-style prefix LM with alternating sliding and full layers, left-padded batch of two.

The config (a dataclass held as `self.cfg`) states `sliding_window=3` and `layer_types`. Each row's prefix (an image
and its prompt, `prefix_lens`) attends both ways. Buggy: the prefix block is OR-ed onto the sliding layer's mask after
the window, so a prefix token sees the whole prefix however far back (transformers#46850's bug, written for a prefix
rather than Gemma 3's image block). Fixed (`--fixed`): AND(window, OR(causal, prefix block)): the window bounds the
prefix on sliding layers too; the full layers keep OR(causal, prefix block). Eager attention: masked_fill, softmax.
"""
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class PrefixLMConfig:
    vocab_size: int = 40
    d_model: int = 32
    n_heads: int = 2
    sliding_window: int = 3
    layer_types: list = field(default_factory=lambda: ["sliding_attention", "full_attention"])
    pad_token_id: int = 0


def layer_mask(attention_mask, prefix_lens, sliding):
    """Bool (B, 1, L, L), True = attend, on each row's own positions (left padding counted out)."""
    b, length = attention_mask.shape
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # each token's position within its row
    q, k = pos[:, :, None], pos[:, None, :]
    causal = k <= q
    prefix = (q < prefix_lens[:, None, None]) & (k < prefix_lens[:, None, None])
    window = q - k < 3 if sliding else torch.ones_like(causal)
    if FIXED:
        allowed = window & (causal | prefix)
    else:
        allowed = (causal & window) | prefix
    real = attention_mask.bool()
    return (allowed & real[:, None, :] & real[:, :, None] | torch.eye(length, dtype=torch.bool))[:, None]


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h, self.d = cfg.n_heads, cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x, mask):
        b, length, _ = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / self.d ** 0.5
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return x + self.out((weights @ v).transpose(1, 2).reshape(b, length, -1))


class PrefixLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_token_id)
        self.layers = nn.ModuleList([Layer(cfg) for _ in cfg.layer_types])

    def forward(self, input_ids, attention_mask, prefix_lens):
        masks = {kind: layer_mask(attention_mask, prefix_lens, kind == "sliding_attention")
                 for kind in set(self.cfg.layer_types)}
        x = self.embed(input_ids)
        for kind, layer in zip(self.cfg.layer_types, self.layers):
            x = layer(x, masks[kind])
        return x


cfg = PrefixLMConfig()
model = PrefixLM(cfg).eval()
input_ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10, 11, 12],
                          [13, 14, 15, 16, 17, 18, 19, 20, 21, 22]])
attention_mask = (input_ids != cfg.pad_token_id).long()
prefix_lens = torch.tensor([6, 7])  # row 0: its 6 first real tokens are the prefix; row 1: its first 7
with torch.no_grad():
    out = model(input_ids, attention_mask, prefix_lens)
print(f"fixed={FIXED} out[1, 6, :3] = {[round(v, 4) for v in out[1, 6, :3].tolist()]}")
