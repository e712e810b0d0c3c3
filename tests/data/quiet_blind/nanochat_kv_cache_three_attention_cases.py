"""nanochat (karpathy/nanochat nanochat/gpt.py, nanochat/engine.py): one attention, three masks by shape.

Follows karpathy/nanochat: GPTConfig dataclass (sequence_len, vocab_size, n_layer, n_head, n_kv_head, n_embd),
rotary embeddings with QK norm, GQA through `enable_gqa`, and the KVCache of engine.py (`insert_kv` writes the new
keys at `pos` and returns the cache up to the end of the new tokens; `pos` advances after the last layer).
CausalSelfAttention.forward picks the mask from the shapes:
- no cache or Tq == Tk (training, or the first prefill): `is_causal=True`;
- Tq == 1 (decoding one token): `is_causal=False`, the new token sees the whole cache;
- otherwise (a chunk after a cached prefix): a bool mask, True on all prefix columns and tril on the chunk.

Masks meant: causal over absolute positions in all three cases; the prompt is prefilled in two chunks (5 then
3 tokens) and then 3 tokens are decoded one by one. The result is checked against a no-cache forward.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    sequence_len: int = 32
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 32


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary_emb(x, cos, sin):
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], 3)


class KVCache:
    def __init__(self, batch_size, num_heads, seq_len, head_dim, num_layers):
        self.kv_shape = (num_layers, 2, batch_size, num_heads, seq_len, head_dim)
        self.kv_cache = None
        self.pos = 0

    def get_pos(self):
        return self.pos

    def insert_kv(self, layer_idx, k, v):
        if self.kv_cache is None:
            self.kv_cache = torch.empty(self.kv_shape, dtype=k.dtype, device=k.device)
        B, H, T_add, D = k.size()
        t0, t1 = self.pos, self.pos + T_add
        self.kv_cache[layer_idx, 0, :, :, t0:t1] = k
        self.kv_cache[layer_idx, 1, :, :, t0:t1] = v
        key_view = self.kv_cache[layer_idx, 0, :, :, :t1]
        value_view = self.kv_cache[layer_idx, 1, :, :, :t1]
        if layer_idx == self.kv_cache.size(0) - 1:
            self.pos = t1
        return key_view, value_view


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, cos_sin, kv_cache):
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos_sin
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        q, k = norm(q), norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.insert_kv(self.layer_idx, k, v)
        Tq = q.size(2)
        Tk = k.size(2)
        enable_gqa = self.n_head != self.n_kv_head
        if kv_cache is None or Tq == Tk:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
        elif Tq == 1:
            # one new token attends to everything already in the cache
            y = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=enable_gqa)
        else:
            attn_mask = torch.zeros((Tq, Tk), dtype=torch.bool, device=q.device)  # True = keep
            prefix_len = Tk - Tq
            if prefix_len > 0:
                attn_mask[:, :prefix_len] = True
            attn_mask[:, prefix_len:] = torch.tril(torch.ones((Tq, Tq), dtype=torch.bool, device=q.device))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x, cos_sin, kv_cache):
        x = x + self.attn(norm(x), cos_sin, kv_cache)
        return x + self.c_proj(F.relu(self.c_fc(norm(x))).square())


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        head_dim = config.n_embd // config.n_head
        self.rotary_seq_len = config.sequence_len * 2
        cos, sin = self._precompute_rotary_embeddings(self.rotary_seq_len, head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _precompute_rotary_embeddings(self, seq_len, head_dim, base=10000):
        channel_range = torch.arange(0, head_dim, 2, dtype=torch.float32)
        inv_freq = 1.0 / (base ** (channel_range / head_dim))
        t = torch.arange(seq_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]

    def forward(self, idx, kv_cache=None):
        B, T = idx.size()
        T0 = 0 if kv_cache is None else kv_cache.get_pos()
        cos_sin = self.cos[:, T0:T0 + T], self.sin[:, T0:T0 + T]
        x = norm(self.wte(idx))
        for block in self.h:
            x = block(x, cos_sin, kv_cache)
        return self.lm_head(norm(x))


def main():
    torch.manual_seed(42)
    config = GPTConfig()
    model = GPT(config).eval()
    prompt = torch.randint(0, config.vocab_size, (2, 8))
    head_dim = config.n_embd // config.n_head
    kv_cache = KVCache(batch_size=2, num_heads=config.n_kv_head, seq_len=config.sequence_len, head_dim=head_dim,
                       num_layers=config.n_layer)
    with torch.no_grad():
        model(prompt[:, :5], kv_cache=kv_cache)  # first prefill: Tq == Tk
        logits = model(prompt[:, 5:], kv_cache=kv_cache)  # second chunk: prefix + tril
        tokens = prompt
        for _ in range(3):
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
            logits = model(next_token, kv_cache=kv_cache)  # Tq == 1
        full = model(tokens)  # no cache, is_causal=True
    assert torch.allclose(full[:, -1], logits[:, -1], atol=1e-4)
    print(tokens[:, 8:].tolist())


if __name__ == "__main__":
    main()
