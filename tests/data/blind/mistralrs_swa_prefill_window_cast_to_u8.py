"""mistral.rs: the sliding-window prefill mask lost its window when it went through a u8 cast.

Citation: EricLBuehler/mistral.rs#1220 "Sliding window attention fixes" (commit 86190f8b7,
mistralrs-core/src/layers_masker.rs, ``CausalMasker::make_causal_mask_matrix_with_sliding_window``).

The bug: the mask was built from ``make_mask(tgt_len, past_kv_len)`` (u8, 1 = future key), then the
keys older than the window were found with ``apply_tril(ones, past_kv_len - sliding_window - 1)``
and written into an f32 copy of the mask as ``f32::MIN``; the result was cast back to ``U8`` and
``masked_fill(zero, mask, NEG_INFINITY)`` turned the 1s into -inf. candle's f32 -> u8 cast is
Rust's saturating ``as u8``, so ``f32::MIN`` became 0: the out-of-window keys were kept, and a
prompt longer than the window attended its whole causal history on the sliding layers.

The fix: ``make_swa_mask`` builds the float mask directly, ``-inf`` where ``i < j || j +
sliding_window < i``, with ``past_kv_len`` clamped to ``sliding_window - tgt_len`` (what the
rotating cache returns), zero columns for the past prepended.

Ported to torch at toy sizes (Mistral config, random weights, 2 layers, sliding_window shrunk
from 4096 to 4, a 12-token prompt, eager attention adding the mask to the scores). candle's
``to_dtype(U8)`` is written as a saturating cast (clamp to [0, 255]) as candle does it.
"""

import math
import sys

import torch
from torch import nn
from transformers import MistralConfig

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# candle's CPU f32 -> u8 cast: ``|v| v as u8`` (saturating in Rust)
def to_dtype_u8(xs):
    return xs.clamp(0, 255).to(torch.uint8)


# https://github.com/mokeyish/candle-ext/blob/main/src/triangular.rs
def apply_tril(xs, diagonal):
    l, s = xs.shape
    xs_tri = []
    for i in range(l):
        for j in range(s):
            cond = i + diagonal < j
            xs_tri.append(0 if cond else 1)
    return xs * torch.tensor(xs_tri, dtype=xs.dtype).reshape(l, s)


# xs are on false (0), value is on true (1)
def masked_fill(xs, mask, value):
    on_true = torch.full(xs.shape, value, dtype=xs.dtype)
    return torch.where(mask.bool(), on_true, xs)


class CausalMasker:
    def make_mask(self, tgt_len, past_kv_len):
        offset = tgt_len + past_kv_len
        mask = [int(j + tgt_len > i + offset) for i in range(tgt_len) for j in range(offset)]
        return torch.tensor(mask, dtype=torch.uint8).reshape(tgt_len, offset)

    def make_swa_mask(self, tgt_len, seqlen_offset, sliding_window, dtype):
        mask = [
            float("-inf") if (i < j or j + sliding_window < i) else 0.0
            for i in range(tgt_len)
            for j in range(tgt_len)
        ]
        mask = torch.tensor(mask, dtype=torch.float32).reshape(tgt_len, tgt_len)
        if seqlen_offset > 0:
            mask0 = torch.zeros(tgt_len, seqlen_offset, dtype=torch.float32)
            mask = torch.cat([mask0, mask], dim=-1)
        return mask.to(dtype)

    def make_causal_mask_matrix_with_sliding_window(self, input_ids, cache, sliding_window, dtype):
        _b_sz, tgt_len = input_ids.shape
        if not FIXED:
            past_kv_len = cache.get_past_kv_len()
            if tgt_len == 1:
                return None
            mask = self.make_mask(tgt_len, past_kv_len)
            diagonal = past_kv_len - sliding_window - 1
            context_mask = apply_tril(torch.ones_like(mask), diagonal)
            causal_mask = to_dtype_u8(masked_fill(mask.to(torch.float32), context_mask, torch.finfo(torch.float32).min))
            zero = torch.tensor(0.0)
            # Mask: 1 means use from x (add 0.0), 0 means mask out (add -inf)
            causal_mask = masked_fill(zero.to(dtype).expand(causal_mask.shape), causal_mask, float("-inf"))
            return causal_mask
        # Compare the past KV len to the sliding window size.
        past_kv_len = min(cache.get_past_kv_len(), max(sliding_window - tgt_len, 0))
        if tgt_len == 1:
            return None
        return self.make_swa_mask(tgt_len, past_kv_len, sliding_window, dtype)


class NormalCache:
    def __init__(self, n_layers):
        self.k = [None] * n_layers
        self.v = [None] * n_layers

    def get_past_kv_len(self):
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def append(self, layer_idx, k, v):
        if self.k[layer_idx] is not None:
            k = torch.cat([self.k[layer_idx], k], dim=2)
            v = torch.cat([self.v[layer_idx], v], dim=2)
        self.k[layer_idx], self.v[layer_idx] = k, v
        return k, v


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim, base):
        super().__init__()
        self.inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))

    def forward(self, q, k, seqlen_offset):
        t = torch.arange(seqlen_offset, seqlen_offset + q.shape[2]).float()
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, 10000.0)

    def forward(self, xs, attention_mask, seqlen_offset, cache, layer_idx):
        b_sz, q_len, _ = xs.shape
        q = self.q_proj(xs).reshape(b_sz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(xs).reshape(b_sz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(xs).reshape(b_sz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary_emb(q, k, seqlen_offset)
        k, v = cache.append(layer_idx, k, v)
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        att = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            att = att + attention_mask
        att = torch.softmax(att, dim=-1)
        out = (att @ v).transpose(1, 2).reshape(b_sz, q_len, -1)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False),
            nn.SiLU(),
            nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False),
        )

    def forward(self, xs, mask, seqlen_offset, cache, layer_idx):
        xs = xs + self.self_attn(self.input_layernorm(xs), mask, seqlen_offset, cache, layer_idx)
        return xs + self.mlp(self.post_attention_layernorm(xs))


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.cache = NormalCache(cfg.num_hidden_layers)

    def forward(self, input_ids, seqlen_offset):
        xs = self.embed_tokens(input_ids)
        attention_mask = CausalMasker().make_causal_mask_matrix_with_sliding_window(
            input_ids, self.cache, self.cfg.sliding_window, xs.dtype
        )
        for i, layer in enumerate(self.layers):
            xs = layer(xs, attention_mask, seqlen_offset, self.cache, i)
        return self.lm_head(self.norm(xs))


cfg = MistralConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=4,
)
model = Model(cfg).eval()

prompt = torch.randint(0, cfg.vocab_size, (1, 12))
with torch.no_grad():
    logits = model(prompt, seqlen_offset=0)
print("prompt:", prompt.tolist())
print("last-token logits[:6]:", [round(x, 4) for x in logits[0, -1, :6].tolist()])
print("next token:", int(logits[0, -1].argmax()))
print("per-position argmax:", logits[0].argmax(-1).tolist())
