"""A Llama 4 style chunked layer, hand-written, over a left-padded batch: the chunks counted from column 0 instead of
each row's first real token (--fixed counts them as transformers does)."""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Config:
    hidden_size: int = 8
    attention_chunk_size: int = 3
    num_hidden_layers: int = 2


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, -1)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(1)


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(32, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids, attention_mask):
        n, c = input_ids.shape[1], self.config.attention_chunk_size
        i = torch.arange(n)
        left = (attention_mask.cumsum(-1) == 0).sum(-1)[:, None, None]  # each row's left padding
        qi, ki = i[None, :, None], i[None, None, :]
        if FIXED:
            same = (qi - left) // c == (ki - left) // c
        else:
            same = (qi // c == ki // c).expand(len(input_ids), n, n)
        mask = same & (ki <= qi) & attention_mask.bool()[:, None, :]
        mask = mask | ~mask.any(-1, keepdim=True)  # padding rows see every key (no NaN)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, mask[:, None])
        return x


torch.manual_seed(0)
ids = torch.tensor([[0, 0, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8]])
Model(Config())(ids, (ids != 0).long())
