# vllm-project/vllm-metal#144 ("Fix prefix cache restore to set KV offset explicitly", merged 2026-03).
#
# vllm-metal's model runner (vllm_metal/v1/model_runner.py) keeps a PrefixCacheManager (added in #80): after a
# prefill it snapshots each layer's KVCache.state (keys, values) under a hash of the prompt tokens, and on the next
# identical request it builds fresh caches with make_prompt_cache() and restores them with
# `layer_cache.state = (k, v)`. The restore relied on the state setter to move `offset`; with a KVCache whose
# setter does not, offset stays 0 after a hit, so the next forward writes its K/V at slot 0 (over the first cached
# prompt token), fetches keys[:, :, :offset] (only itself) and applies RoPE at position 0.
# Fix: restore sets `layer_cache.offset = k.shape[2]` explicitly after assigning the state.
#
# Ported to torch (mx -> torch) at tiny sizes: mlx-lm style KVCache.update_and_fetch, rope(offset=cache.offset),
# SDPA with mask "causal" for a multi-token prefill and None for one token.
import hashlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ModelArgs:
    vocab_size = 64
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 10000.0


class KVCache:
    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        prev = self.offset
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            new_k = torch.zeros(B, n_kv_heads, n_steps * self.step, k_head_dim, dtype=keys.dtype)
            new_v = torch.zeros(B, n_kv_heads, n_steps * self.step, values.shape[3], dtype=values.dtype)
            if self.keys is not None:
                new_k = torch.cat([self.keys[..., :prev, :], new_k], dim=2)
                new_v = torch.cat([self.values[..., :prev, :], new_v], dim=2)
            self.keys, self.values = new_k, new_v
        self.offset += keys.shape[2]
        self.keys[..., prev:self.offset, :] = keys
        self.values[..., prev:self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def state(self):
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @state.setter
    def state(self, v):
        self.keys, self.values = v


def make_prompt_cache(model):
    return [KVCache() for _ in model.layers]


def rope(x, offset, base):
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    pos = torch.arange(offset, offset + x.shape[2], dtype=torch.float32)
    ang = pos[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.hidden_size // self.n_heads
        self.scale = self.head_dim ** -0.5
        self.rope_theta = args.rope_theta
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def forward(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        queries = self.q_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        keys = self.k_proj(x).view(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = self.v_proj(x).view(B, L, self.n_kv_heads, -1).transpose(1, 2)
        if cache is not None:
            queries = rope(queries, cache.offset, self.rope_theta)
            keys = rope(keys, cache.offset, self.rope_theta)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = rope(queries, 0, self.rope_theta)
            keys = rope(keys, 0, self.rope_theta)
        output = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=(mask == "causal"), scale=self.scale, enable_gqa=True
        )
        return self.o_proj(output.transpose(1, 2).reshape(B, L, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = nn.Sequential(nn.Linear(args.hidden_size, 64), nn.SiLU(), nn.Linear(64, args.hidden_size))
        self.input_layernorm = nn.RMSNorm(args.hidden_size)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size)

    def forward(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def create_attention_mask(h, cache):
    return "causal" if h.shape[1] > 1 else None


class Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.num_hidden_layers))
        self.norm = nn.RMSNorm(args.hidden_size)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.lm_head(self.norm(h))


def _compute_prefix_hash(token_ids):
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


class PrefixCacheManager:
    def __init__(self):
        self._cache = {}
        self.hits = 0
        self.misses = 0

    def lookup(self, token_ids):
        entry = self._cache.get(_compute_prefix_hash(token_ids))
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
        return entry

    def insert(self, token_ids, cache):
        cache_state = []
        for layer_cache in cache:
            if isinstance(layer_cache, KVCache):
                k = layer_cache.state[0]
                v = layer_cache.state[1]
                cache_state.append((k.clone(), v.clone()))
        self._cache[_compute_prefix_hash(token_ids)] = cache_state

    def restore(self, model, cache_state):
        cache = make_prompt_cache(model)
        for layer_cache, (k, v) in zip(cache, cache_state):
            layer_cache.state = (k.clone(), v.clone())
            if FIXED:
                layer_cache.offset = k.shape[2]
        return cache


class MetalModelRunner:
    def __init__(self, model):
        self.model = model
        self._prefix_cache = PrefixCacheManager()

    @torch.no_grad()
    def _prefill_single(self, token_ids):
        prefix = token_ids[:-1]
        cached = self._prefix_cache.lookup(prefix)
        if cached is not None:
            cache = self._prefix_cache.restore(self.model, cached)
        else:
            cache = make_prompt_cache(self.model)
            self.model(torch.tensor([prefix]), cache=cache)
            self._prefix_cache.insert(prefix, cache)
        logits = self.model(torch.tensor([token_ids[-1:]]), cache=cache)
        return logits[:, -1, :], cache

    @torch.no_grad()
    def generate(self, token_ids, max_tokens=6):
        logits, cache = self._prefill_single(token_ids)
        out = []
        for _ in range(max_tokens):
            tok = int(logits.argmax(-1))
            out.append(tok)
            logits = self.model(torch.tensor([[tok]]), cache=cache)[:, -1, :]
        return out


def main():
    model = Model(ModelArgs()).eval()
    runner = MetalModelRunner(model)
    system_prompt = [5, 17, 42, 8, 23, 61, 3, 30, 12, 50, 7]
    first = runner.generate(system_prompt)
    second = runner.generate(system_prompt)
    print("request 1 (prefix cache miss):", first)
    print("request 2 (prefix cache hit): ", second)
    print("hits", runner._prefix_cache.hits, "misses", runner._prefix_cache.misses)


if __name__ == "__main__":
    main()
