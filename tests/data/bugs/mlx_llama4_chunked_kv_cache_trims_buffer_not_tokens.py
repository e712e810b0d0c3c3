"""mlx-lm Llama 4: ChunkedKVCache.maybe_trim_front trims on the padded buffer size, dropping live chunk keys.

Citation: ml-explore/mlx-lm#1673 "Fix ChunkedKVCache dropping valid tokens during decode (llama4)" (commit
e03e45ed). ``ChunkedKVCache`` grows its key/value buffers in steps of ``step`` slots, so ``keys.shape[2]`` is
the allocated size, not the number of cached tokens. ``maybe_trim_front`` (called by ``LlamaModel`` before
every step for the chunked layers) kept the last ``chunk_size`` *slots* and advanced ``start_position`` by
``keys.shape[2] - chunk_size``: with unfilled slots at the end of the buffer it threw away keys of the
current chunk that the query should still see, and the chunk mask (built from ``start_position``) agreed
with the loss. The fix trims on ``valid = offset - start_position`` and only when ``valid > chunk_size``.

This is a torch port of mlx_lm/models/cache.py's ChunkedKVCache / KVCache and llama4.py's attention and
chunk mask (``linds // attention_chunk_size == rinds // attention_chunk_size`` and ``linds <= rinds``), with
F.scaled_dot_product_attention taking the boolean mask. To keep it small, ``step`` is 8 and
``attention_chunk_size`` 12 (upstream: 256 and 8192). The upstream regression test used a chunk size smaller
than the step (4 < 256), where the old code slices with negative indices that torch cannot follow; a chunk size
that is not a multiple of the step loses live keys the same way (a query at chunk offset 4..7 sees only 6..8 of
its chunk's keys). Prompt of 9 tokens then 12 decode steps; no MoE, no temperature tuning.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class TextArgs:
    vocab_size: int = 100
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_hidden_layers: int = 4
    attention_chunk_size: int = 12
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    no_rope_layers: tuple = (1, 1, 1, 0)


class KVCache:
    step = 8

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
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset += keys.shape[2]
        self.keys[..., prev:self.offset, :] = keys
        self.values[..., prev:self.offset, :] = values
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]


class ChunkedKVCache(KVCache):
    def __init__(self, chunk_size):
        super().__init__()
        self.chunk_size = chunk_size
        self.start_position = 0

    def maybe_trim_front(self):
        # Maintain the cache below the chunk size
        if FIXED:
            if self.keys is None:
                return
            valid = self.offset - self.start_position
            if valid > self.chunk_size:
                trim = valid - self.chunk_size
                self.start_position += trim
                self.keys = self.keys[..., trim:valid, :]
                self.values = self.values[..., trim:valid, :]
        elif self.keys is not None and self.keys.shape[2] >= self.chunk_size:
            self.start_position += self.keys.shape[2] - self.chunk_size
            self.keys = self.keys[..., -self.chunk_size:, :]
            self.values = self.values[..., -self.chunk_size:, :]

    def update_and_fetch(self, keys, values):
        prev = self.offset - self.start_position
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            new_k = torch.zeros(B, n_kv_heads, n_steps * self.step, k_head_dim, dtype=keys.dtype)
            new_v = torch.zeros(B, n_kv_heads, n_steps * self.step, values.shape[3], dtype=values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset += keys.shape[2]
        end = self.offset - self.start_position
        self.keys[..., prev:end, :] = keys
        self.values[..., prev:end, :] = values
        return self.keys[..., :end, :], self.values[..., :end, :]


def rope(x, offset, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(offset, offset + x.shape[2]).float()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, args, layer_idx):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim ** -0.5
        self.use_rope = int((layer_idx + 1) % 4 != 0)
        self.theta = args.rope_theta
        self.q_proj = nn.Linear(args.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=False)

    def forward(self, x, mask=None, cache=None):
        B, L, D = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        offset = cache.offset if cache is not None else 0
        if self.use_rope:
            queries = rope(queries, offset, self.theta)
            keys = rope(keys, offset, self.theta)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale,
                                                enable_gqa=True)
        return self.o_proj(output.transpose(1, 2).reshape(B, L, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args, layer_idx):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.feed_forward = nn.Sequential(nn.Linear(args.hidden_size, 128), nn.SiLU(), nn.Linear(128, args.hidden_size))

    def forward(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.feed_forward(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(args, i) for i in range(args.num_hidden_layers)])
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.attention_chunk_size = args.attention_chunk_size

    def forward(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        if cache is not None:
            for idx, c in enumerate(cache):
                if (idx + 1) % 4 != 0:
                    c.maybe_trim_front()
            start = cache[0].start_position
            offset = cache[0].offset
        else:
            start = 0
            offset = 0
        end = offset + h.shape[1]
        linds = torch.arange(start, end)
        rinds = torch.arange(offset, end)[:, None]
        block_pos = torch.abs((linds // self.attention_chunk_size) - (rinds // self.attention_chunk_size))
        token_pos = linds <= rinds
        chunk_mask = (block_pos == 0) & token_pos

        if cache is None:
            cache = [None] * len(self.layers)
        # create_attention_mask: causal for a multi-token step, None for one token
        global_mask = None
        if h.shape[1] > 1:
            g_off = cache[3].offset if cache[3] is not None else 0
            global_mask = torch.arange(g_off + h.shape[1]) <= torch.arange(g_off, g_off + h.shape[1])[:, None]

        for idx, (layer, c) in enumerate(zip(self.layers, cache)):
            use_chunked_attention = (idx + 1) % 4 != 0
            mask = chunk_mask if use_chunked_attention else global_mask
            h = layer(h, mask, cache=c)
        return self.norm(h)


def make_prompt_cache(args):
    return [ChunkedKVCache(args.attention_chunk_size) if (i + 1) % 4 != 0 else KVCache()
            for i in range(args.num_hidden_layers)]


def main():
    torch.manual_seed(0)
    args = TextArgs()
    model = LlamaModel(args).eval()
    lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
    prompt = torch.randint(0, args.vocab_size, (1, 9))
    cache = make_prompt_cache(args)
    tokens = []
    with torch.no_grad():
        h = model(prompt, cache=cache)
        for _ in range(12):
            nxt = lm_head(h[:, -1]).argmax(-1, keepdim=True)
            tokens.append(int(nxt))
            h = model(nxt, cache=cache)
    print("generated", tokens, "chunk cache start_position", cache[0].start_position)


if __name__ == "__main__":
    main()
