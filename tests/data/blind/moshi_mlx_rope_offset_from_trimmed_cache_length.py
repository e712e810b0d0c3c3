# kyutai-labs/moshi commit 7892056 ("Use the fancy KV caches for MLX"), bug as the code stood at 515e959
# (msh_mlx/modules/transformer.py, Attention.__call__), ported from MLX to torch.
#
# Bug: the streaming transformer keeps its KV cache as a (k, v) tuple trimmed to the last `cfg.context`
# keys, and takes the RoPE offset of each new step from the cache's length (`cache[0].shape[2]`). Once the
# cache is trimmed the length stops growing, so every later token is rotated at position `context` while
# the cached keys keep the positions they were written at: the query/key distances are wrong.
# Fix: the cache object counts the tokens it has seen (`cache.offset`) and RoPE uses that absolute count.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class TransformerConfig:
    d_model: int = 32
    num_heads: int = 4
    num_layers: int = 2
    dim_feedforward: int = 128
    kv_repeat: int = 1
    context: int = 6
    max_period: float = 10000.0
    bias_attn: bool = False
    bias_ff: bool = False

    @property
    def head_dim(self):
        return self.d_model // self.num_heads


def rope_traditional(x, offset, base):
    # mlx nn.RoPE(traditional=True): rotates interleaved pairs (x[..., 0::2], x[..., 1::2])
    b, h, t, d = x.shape
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    pos = torch.arange(offset, offset + t, dtype=torch.float32)
    ang = pos[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.reshape(b, h, t, d)


class KVCache:
    """After the fix: the cache keeps the keys and the number of tokens it has seen."""

    def __init__(self, context):
        self.context = context
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, k, v):
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
        self.offset += k.shape[2]
        t = k.shape[2]
        k_len = self.keys.shape[2]
        k_target_len = t + min(self.context, k_len - t)
        if k_target_len < k_len:
            self.keys = self.keys[:, :, k_len - k_target_len:]
            self.values = self.values[:, :, k_len - k_target_len:]
        return self.keys, self.values


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        num_kv = cfg.num_heads // cfg.kv_repeat
        out_dim = cfg.d_model + 2 * num_kv * cfg.d_model // cfg.num_heads
        self.cfg = cfg
        self.in_proj = nn.Linear(cfg.d_model, out_dim, bias=cfg.bias_attn)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias_attn)
        self.scale = cfg.head_dim ** (-0.5)

    def forward(self, xs, mask=None, cache=None):
        assert self.cfg.kv_repeat == 1, "only kv_repeat==1 is supported"
        b, t, hd = xs.shape
        qkv = self.in_proj(xs).reshape(b, t, 3, self.cfg.num_heads, self.cfg.head_dim)
        q = qkv[:, :, 0].transpose(1, 2)
        k = qkv[:, :, 1].transpose(1, 2)
        v = qkv[:, :, 2].transpose(1, 2)

        if FIXED:
            q = rope_traditional(q, cache.offset, self.cfg.max_period)
            k = rope_traditional(k, cache.offset, self.cfg.max_period)
            k, v = cache.update_and_fetch(k, v)
        else:
            offset = 0
            if cache is not None:
                offset = cache[0].shape[2]
            q = rope_traditional(q, offset, self.cfg.max_period)
            k = rope_traditional(k, offset, self.cfg.max_period)

            if cache is not None:
                k_cache, v_cache = cache
                k = torch.cat([k_cache, k], dim=2)
                v = torch.cat([v_cache, v], dim=2)

            k_len = k.shape[2]
            k_target_len = t + min(self.cfg.context, k_len - t)
            if k_target_len < k_len:
                k = k[:, :, k_len - k_target_len:]
                v = v[:, :, k_len - k_target_len:]
            cache = k, v

        xs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        xs = xs.transpose(1, 2).reshape(b, t, hd)
        xs = self.out_proj(xs)
        return xs, cache


class MlpGating(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden = 2 * cfg.dim_feedforward // 3
        self.linear_in = nn.Linear(cfg.d_model, 2 * hidden, bias=cfg.bias_ff)
        self.linear_out = nn.Linear(hidden, cfg.d_model, bias=cfg.bias_ff)

    def forward(self, xs):
        xs = self.linear_in(xs)
        b, t, _ = xs.shape
        xs = xs.reshape(b, t, 2, -1)
        return self.linear_out(F.silu(xs[:, :, 0]) * xs[:, :, 1])


class TransformerLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model, eps=1e-8)
        self.norm2 = nn.RMSNorm(cfg.d_model, eps=1e-8)
        self.mlp = MlpGating(cfg)
        self.self_attn = Attention(cfg)

    def forward(self, xs, cache=None):
        n1 = self.norm1(xs)
        n1, cache = self.self_attn(n1, cache=cache)
        xs = xs + n1
        xs = xs + self.mlp(self.norm2(xs))
        return xs, cache


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([TransformerLayer(cfg) for _ in range(cfg.num_layers)])

    def forward(self, xs, cache=None):
        if FIXED:
            for layer, c in zip(self.layers, cache):
                xs, _ = layer(xs, cache=c)
            return xs, cache
        upd_cache = []
        for layer_idx, layer in enumerate(self.layers):
            c = cache[layer_idx] if cache is not None else None
            xs, c = layer(xs, c)
            upd_cache.append(c)
        return xs, upd_cache

    def make_cache(self):
        return [KVCache(self.cfg.context) for _ in self.layers]


class LmSketch(nn.Module):
    """Text stream of the LM: embedding, streaming transformer, head; greedy, one frame per step."""

    def __init__(self, cfg, card=48):
        super().__init__()
        self.emb = nn.Embedding(card, cfg.d_model)
        self.transformer = Transformer(cfg)
        self.out_norm = nn.RMSNorm(cfg.d_model, eps=1e-8)
        self.text_linear = nn.Linear(cfg.d_model, card, bias=False)


cfg = TransformerConfig()
lm = LmSketch(cfg).eval()

steps = 16
token = torch.tensor([[3]])
cache = lm.transformer.make_cache() if FIXED else None
generated = []
last_logits = None
with torch.no_grad():
    for step in range(steps):
        xs = lm.emb(token)
        xs, cache = lm.transformer(xs, cache=cache)
        logits = lm.text_linear(lm.out_norm(xs))[:, -1]
        token = logits.argmax(-1, keepdim=True)
        generated.append(int(token))
        last_logits = logits

print("generated:", generated)
print("last logits[:6]:", [round(float(x), 4) for x in last_logits[0, :6]])
