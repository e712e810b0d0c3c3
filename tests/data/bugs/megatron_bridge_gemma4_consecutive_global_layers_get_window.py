# NVIDIA-NeMo/Megatron-Bridge#5441: _is_local_attn_layer used only sum(interleaved_attn_pattern), so with
# (3, 2) (three sliding layers, then two full layers) layer 4 was built as a sliding-window layer.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def _is_local_attn_layer(layer_number: int, layer_pattern: tuple) -> bool:
    if FIXED:
        local_layer_count = int(layer_pattern[0])
        pattern_size = local_layer_count + int(layer_pattern[1])
        return (layer_number - 1) % pattern_size < local_layer_count
    pattern_size = sum(layer_pattern)
    return layer_number % pattern_size != 0


@dataclass
class Gemma4ModelProvider:
    num_layers: int = 5
    hidden_size: int = 32
    num_attention_heads: int = 4
    kv_channels: int = 8
    window_size: int = 3
    interleaved_attn_pattern: tuple = (3, 2)  # (sliding, global)
    vocab_size: int = 96


class Gemma4DotProductAttention(nn.Module):
    """Core attention: sliding-window causal on local layers, plain causal on global layers."""

    def __init__(self, config: Gemma4ModelProvider, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        self.window_size = None
        if _is_local_attn_layer(layer_number, config.interleaved_attn_pattern):
            self.window_size = (config.window_size - 1, 0)

    def forward(self, query, key, value):
        # [b, np, s, hn]
        s = query.size(2)
        if self.window_size is None:
            return F.scaled_dot_product_attention(query, key, value, is_causal=True)
        i = torch.arange(s)[:, None]
        j = torch.arange(s)[None, :]
        attn_mask = (j <= i) & (i - j <= self.window_size[0])
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask)


class Gemma4TransformerLayer(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        c = config
        self.np, self.hn = c.num_attention_heads, c.kv_channels
        self.input_layernorm = nn.RMSNorm(c.hidden_size)
        self.linear_qkv = nn.Linear(c.hidden_size, 3 * self.np * self.hn, bias=False)
        self.core_attention = Gemma4DotProductAttention(c, layer_number)
        self.linear_proj = nn.Linear(self.np * self.hn, c.hidden_size, bias=False)
        self.pre_mlp_layernorm = nn.RMSNorm(c.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(c.hidden_size, 64), nn.GELU(approximate="tanh"), nn.Linear(64, c.hidden_size))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.linear_qkv(self.input_layernorm(x)).view(b, s, 3, self.np, self.hn).permute(2, 0, 3, 1, 4)
        ctx = self.core_attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.linear_proj(ctx)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Gemma4Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        # MCore layer numbers are 1-based
        self.layers = nn.ModuleList([Gemma4TransformerLayer(config, i + 1) for i in range(config.num_layers)])
        self.final_layernorm = nn.RMSNorm(config.hidden_size)

    def forward(self, input_ids):
        x = self.embedding(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.final_layernorm(x) @ self.embedding.weight.t()


def main():
    torch.manual_seed(0)
    # HF side: layer_types = ["sliding_attention"] * 3 + ["full_attention"] * 2 -> interleaved_attn_pattern=(3, 2)
    config = Gemma4ModelProvider()
    model = Gemma4Model(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    input_ids = torch.randint(0, config.vocab_size, (2, 16))

    logits = model(input_ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), input_ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    print(f"train loss: {loss.item():.5f}  last-position logit sum: {logits[:, -1].sum().item():.5f}")


if __name__ == "__main__":
    main()
