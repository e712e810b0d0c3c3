# NVIDIA-NeMo/Megatron-Bridge#4875: Gemma2DotProductAttention put the sliding window on even one-based
# layer_numbers, but HF Gemma2 slides on layer 0 (= MCore layer 1): every layer got the other attention type.
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


@dataclass
class Gemma2Config:  # the HF side of the contract
    num_hidden_layers: int = 4
    sliding_window: int = 4
    layer_types: tuple = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")


@dataclass
class TransformerConfig:  # what the bridge provider builds from it
    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int = 8
    query_pre_attn_scalar: int = 8
    attn_logit_softcapping: float = 50.0
    window_size: tuple = (4, 0)


def logit_softcapping(logits, scale):
    if not scale:
        return logits
    return scale * torch.tanh(logits / scale)


def get_swa(seq_q, seq_kv, window_size):
    """Create the equivalent attention mask for SWA in [seq_q, seq_kv] shape"""
    m = torch.ones(seq_q, seq_kv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=seq_kv - seq_q - window_size[0])
    ml = torch.tril(mu, diagonal=seq_kv - seq_q + window_size[1])
    return ~ml


def attention_mask_func(attention_scores, attention_mask):
    return attention_scores.masked_fill(attention_mask, -10000.0)


class Gemma2DotProductAttention(nn.Module):
    def __init__(self, config: TransformerConfig, layer_number: int):
        super().__init__()
        self.config = config
        self.layer_number = max(1, layer_number)
        self.window_size = None
        if (self.layer_number % 2 == 1) if FIXED else (self.layer_number % 2 == 0):
            self.window_size = config.window_size
        self.np = config.num_attention_heads
        self.ng = config.num_query_groups
        self.norm_factor = math.sqrt(config.query_pre_attn_scalar)

    def forward(self, query, key, value, attention_mask):
        # query/key/value: [s, b, n, hn]
        key = key.repeat_interleave(self.np // self.ng, dim=2)
        value = value.repeat_interleave(self.np // self.ng, dim=2)
        output_size = (query.size(1), query.size(2), query.size(0), key.size(0))
        query = query.reshape(output_size[2], output_size[0] * output_size[1], -1)
        key = key.reshape(output_size[3], output_size[0] * output_size[1], -1)
        buf = torch.empty(output_size[0] * output_size[1], output_size[2], output_size[3])
        matmul_result = torch.baddbmm(buf, query.transpose(0, 1), key.transpose(0, 1).transpose(1, 2),
                                      beta=0.0, alpha=1.0 / self.norm_factor)
        matmul_result = logit_softcapping(matmul_result, self.config.attn_logit_softcapping)
        attention_scores = matmul_result.view(*output_size)
        if attention_mask is not None and self.window_size is not None:
            attention_mask = get_swa(query.size(0), key.size(0), self.window_size)
        attention_probs = torch.softmax(attention_mask_func(attention_scores, attention_mask), dim=-1)
        value = value.reshape(value.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context = torch.bmm(attention_probs, value.transpose(0, 1))
        context = context.view(output_size[0], output_size[1], output_size[2], -1).permute(2, 0, 1, 3)
        return context.reshape(context.size(0), context.size(1), -1)


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        c = config
        self.c = c
        self.norm = nn.RMSNorm(c.hidden_size)
        self.linear_qkv = nn.Linear(c.hidden_size, (c.num_attention_heads + 2 * c.num_query_groups) * c.kv_channels, bias=False)
        self.core_attention = Gemma2DotProductAttention(c, layer_number)
        self.linear_proj = nn.Linear(c.num_attention_heads * c.kv_channels, c.hidden_size, bias=False)
        self.mlp = nn.Sequential(nn.RMSNorm(c.hidden_size), nn.Linear(c.hidden_size, 64), nn.GELU(), nn.Linear(64, c.hidden_size))

    def forward(self, hidden, attention_mask):
        s, b, _ = hidden.shape
        c = self.c
        qkv = self.linear_qkv(self.norm(hidden))
        q, k, v = qkv.split([c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels,
                             c.num_query_groups * c.kv_channels], dim=-1)
        q = q.view(s, b, c.num_attention_heads, c.kv_channels)
        k = k.view(s, b, c.num_query_groups, c.kv_channels)
        v = v.view(s, b, c.num_query_groups, c.kv_channels)
        hidden = hidden + self.linear_proj(self.core_attention(q, k, v, attention_mask))
        return hidden + self.mlp(hidden)


def main():
    torch.manual_seed(0)
    hf = Gemma2Config()
    config = TransformerConfig(num_layers=hf.num_hidden_layers, window_size=(hf.sliding_window - 1, 0))
    layers = nn.ModuleList([TransformerLayer(config, i + 1) for i in range(config.num_layers)])  # MCore: 1-based
    emb = nn.Embedding(100, config.hidden_size)

    seq, batch = 12, 2
    tokens = torch.randint(0, 100, (batch, seq))
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    hidden = emb(tokens).transpose(0, 1)
    for layer in layers:
        hidden = layer(hidden, causal)
    logits = hidden.transpose(0, 1) @ emb.weight.t()

    print(f"last-token logit[0]: {logits[0, -1, 0].item():.5f}  sum|logits|: {logits.abs().sum().item():.3f}")


if __name__ == "__main__":
    main()
