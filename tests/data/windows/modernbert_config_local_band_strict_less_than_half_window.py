"""A hand-written ModernBERT-style encoder over transformers' ModernBertConfig: its local layers' band counted one key
short on each side (maskcli's own reproduction of the bug in vllm-project/vllm#44040, written another way).

The config states local_attention=6, so transformers sets sliding_window = local_attention // 2 = 3, and ModernBERT
sees keys up to 3 positions away on either side on its local layers (|q - k| <= 3). The buggy version builds the
band as `(q - k).abs() < config.sliding_window`, up to 2 away; the fix uses `<=`. A right-padded batch of three
sentences, key padding from the attention_mask, SDPA with a bool mask.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import ModernBertConfig

FIXED = "--fixed" in sys.argv


class Layer(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size)
        self.layer_type = config.layer_types[layer_id]

    def forward(self, x, mask):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(y.transpose(1, 2).reshape(b, n, c))


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos = nn.Embedding(64, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.num_hidden_layers))

    def forward(self, input_ids, attention_mask):
        n = input_ids.shape[1]
        x = self.embed(input_ids) + self.pos(torch.arange(n))
        keys = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, L): real keys
        distance = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs()
        band = distance <= self.config.sliding_window if FIXED else distance < self.config.sliding_window
        masks = {"full_attention": keys, "sliding_attention": keys & band}
        for layer in self.layers:
            x = layer(x, masks[layer.layer_type])
        return x


torch.manual_seed(0)
config = ModernBertConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, local_attention=6, global_attn_every_n_layers=3)
model = Encoder(config).eval()
lengths = [12, 9, 5]
input_ids = torch.randint(1, 50, (3, 12))
attention_mask = (torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]).long()
input_ids = input_ids * attention_mask
with torch.no_grad():
    hidden = model(input_ids, attention_mask)
for row, length in enumerate(lengths):
    pooled = hidden[row, :length].mean(0)
    print(f"sentence {row} ({length} tokens): mean-pooled {pooled[:4].tolist()}")
