"""gpt-oss reference torch model: grouped-query attention over one unbatched token stream, a learned
per-head "sink" logit appended as an extra softmax column and then dropped, and a sliding window on
even layers only (sliding_window == 0 means full causal on odd layers).

Follows openai/gpt-oss gpt_oss/torch/model.py: `sdpa(Q, K, V, S, sm_scale, sliding_window)` builds
`mask = torch.triu(full(-inf), diagonal=1)` and, when sliding_window > 0, adds
`torch.tril(full(-inf), diagonal=-sliding_window)`; AttentionBlock sets
`self.sliding_window = config.sliding_window if layer_idx % 2 == 0 else 0`; ModelConfig dataclass
(here scaled down: sliding_window=4).  Keys/values are shared by q_mult query heads per KV head.

Mask meant: even layers = causal band of the last `sliding_window` keys (q - window < k <= q); odd
layers = plain causal.  The sink column lets a row put weight on "nothing"; rows do not sum to 1.
"""
import math
from dataclasses import dataclass

import torch


@dataclass
class ModelConfig:
    num_hidden_layers: int = 4
    vocab_size: int = 64
    hidden_size: int = 32
    head_dim: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    sliding_window: int = 4
    rope_theta: float = 150000.0


def sdpa(Q, K, V, S, sm_scale, sliding_window=0):
    # sliding_window == 0 means no sliding window
    n_tokens, n_heads, q_mult, d_head = Q.shape
    assert K.shape == (n_tokens, n_heads, d_head)
    assert V.shape == (n_tokens, n_heads, d_head)
    K = K[:, :, None, :].expand(-1, -1, q_mult, -1)
    V = V[:, :, None, :].expand(-1, -1, q_mult, -1)
    S = S.reshape(n_heads, q_mult, 1, 1).expand(-1, -1, n_tokens, -1)
    mask = torch.triu(Q.new_full((n_tokens, n_tokens), -float("inf")), diagonal=1)
    if sliding_window > 0:
        mask += torch.tril(mask.new_full((n_tokens, n_tokens), -float("inf")), diagonal=-sliding_window)
    QK = torch.einsum("qhmd,khmd->hmqk", Q, K)
    QK *= sm_scale
    QK += mask[None, None, :, :]
    QK = torch.cat([QK, S], dim=-1)
    W = torch.softmax(QK, dim=-1)
    W = W[..., :-1]
    attn = torch.einsum("hmqk,khmd->qhmd", W, V)
    return attn.reshape(n_tokens, -1)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim, base):
        super().__init__()
        self.head_dim, self.base = head_dim, base

    def forward(self, query, key):
        num_tokens = query.shape[0]
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        freqs = torch.einsum("i,j->ij", torch.arange(num_tokens, dtype=torch.float), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()

        def rot(x):
            shape = x.shape
            x = x.view(num_tokens, -1, self.head_dim)
            x1, x2 = torch.chunk(x, 2, dim=-1)
            c, s = cos[:, None], sin[:, None]
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).reshape(shape)

        return rot(query), rot(key)


class AttentionBlock(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        # Only apply sliding window to every other layer
        self.sliding_window = config.sliding_window if layer_idx % 2 == 0 else 0
        self.sinks = torch.nn.Parameter(torch.randn(config.num_attention_heads))
        self.norm = torch.nn.RMSNorm(config.hidden_size)
        qkv_dim = config.head_dim * (config.num_attention_heads + 2 * config.num_key_value_heads)
        self.qkv = torch.nn.Linear(config.hidden_size, qkv_dim)
        self.out = torch.nn.Linear(config.head_dim * config.num_attention_heads, config.hidden_size)
        self.sm_scale = 1 / math.sqrt(config.head_dim)
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, x):
        t = self.norm(x)
        qkv = self.qkv(t)
        q_end = self.num_attention_heads * self.head_dim
        k_end = q_end + self.num_key_value_heads * self.head_dim
        q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]
        q = q.view(-1, self.num_key_value_heads, self.num_attention_heads // self.num_key_value_heads, self.head_dim)
        k = k.view(-1, self.num_key_value_heads, self.head_dim)
        v = v.view(-1, self.num_key_value_heads, self.head_dim)
        q, k = self.rope(q, k)
        t = sdpa(q, k, v, self.sinks, self.sm_scale, self.sliding_window)
        return x + self.out(t)


class Transformer(torch.nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embedding = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.block = torch.nn.ModuleList(AttentionBlock(config, layer_idx) for layer_idx in range(config.num_hidden_layers))
        self.norm = torch.nn.RMSNorm(config.hidden_size)
        self.unembedding = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, x):
        x = self.embedding(x)
        for block in self.block:
            x = block(x)
        return self.unembedding(self.norm(x))


if __name__ == "__main__":
    torch.manual_seed(0)
    config = ModelConfig()
    model = Transformer(config).eval()
    tokens = torch.randint(0, config.vocab_size, (12,))
    with torch.no_grad():
        logits = model(tokens)
        # a prefix gives the same logits on its positions: every layer is causal
        prefix = model(tokens[:7])
    assert torch.allclose(logits[:7], prefix, atol=1e-5)
    print("next token", int(logits[-1].argmax()))
