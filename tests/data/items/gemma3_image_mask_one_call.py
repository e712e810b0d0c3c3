"""A hand-written Gemma 3 text model (transformers' Gemma3TextConfig) given `image_mask`, one row, one SDPA call per
layer, its mask causal with the image tokens bidirectional.

Bug: the bidirectional part is `image_mask[q] & image_mask[k]`, so the first image sees the second, later one.
Fixed (--fixed): each run of image tokens numbered, and a query sees a later key only of its own image (transformers'
get_block_sequence_ids_for_mask).
With --all-images-one-span: the same all-images mask under a config of the program's own that names no family (a
model that attends all its images as one span, as Molmo2 does, on purpose): correct, not judged wrong."""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Gemma3TextConfig

FIXED = "--fixed" in sys.argv
ONE_SPAN = "--all-images-one-span" in sys.argv


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.heads = config.num_attention_heads

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, d)


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Layer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, input_ids, image_mask):
        n = input_ids.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        if FIXED:
            starts = image_mask & ~F.pad(image_mask, (1, 0))[:, :-1]
            blob = torch.where(image_mask, starts.cumsum(-1), 0)
            both = (blob[:, :, None] == blob[:, None, :]) & (blob[:, :, None] > 0)
        else:
            both = image_mask[:, :, None] & image_mask[:, None, :]
        mask = (causal[None] | both)[:, None]
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, mask)
        return x


torch.manual_seed(0)
config = Gemma3TextConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=8)
ids = torch.tensor([[1, 2, 30, 30, 30, 30, 3, 30, 30, 4, 5]])
if ONE_SPAN:
    config = SimpleNamespace(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
with torch.no_grad():
    print(Model(config)(ids, image_mask=ids == 30).shape)
