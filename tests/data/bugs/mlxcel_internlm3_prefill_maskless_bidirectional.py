"""mlxcel InternLM3: a maskless multi-token prefill runs unmasked (bidirectional) SDPA.

Citation: lablup/mlxcel issue #999, fixed by PR #1001 ("fix(models): make the internlm3, hunyuan
and gemma2 prefills causal"). Same policy as #991 / #998 for deepseek_v2. Rust code; this is a
torch port of `src/models/internlm3.rs` (leaf attention and `InternLM3Model::forward`), written from
the issue and PR descriptions (the Rust diff itself was not read).

Bug: every generation path calls `LanguageModel::forward` with `mask == None`; the documented
contract (`pad_tokens_for_prefill` in generate.rs) is that None means "use the built-in causal
mask". The InternLM3 leaf was `if l > 1 { attention_from_ptr(mask) } else { causal_attention }`,
so a prefill (l > 1) handed the None mask to an unmasked SDPA: every prompt token attended to
later prompt tokens and the KV cache was written from those states.

Fix: `if l > 1 && mask.is_some()`: a maskless multi-token prefill falls to `causal_attention`.

Reproduction: a 2-layer InternLM3-like model (RoPE, GQA) with a KV cache; prefill 6 prompt tokens
with mask=None as the generator does, then 2 greedy decode steps.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class InternLM3Config:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    intermediate_size: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


class KVCache:
    def __init__(self):
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
        return self.keys, self.values


def rope(x, offset, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    pos = torch.arange(offset, offset + x.shape[2], dtype=torch.float32)
    ang = torch.outer(pos, inv)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2)


def attention_from_ptr(q, k, v, scale, mask):
    # mlxcel_core::layers::attention_from_ptr: SDPA with whatever mask pointer it is given
    # (a null pointer means no mask at all).
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def causal_attention(q, k, v, scale):
    # mlxcel_core::causal_attention: bottom-right causal over the cached keys.
    l, s = q.shape[2], k.shape[2]
    if l == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    mask = torch.ones(l, s, dtype=torch.bool).tril(diagonal=s - l)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class InternLM3Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, mask, cache):
        b, l, _ = x.shape
        q = self.q_proj(x).view(b, l, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, l, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, l, self.n_kv, self.head_dim).transpose(1, 2)
        q = rope(q, cache.offset, self.cfg.rope_theta)
        k = rope(k, cache.offset, self.cfg.rope_theta)
        k, v = cache.update_and_fetch(k, v)
        rep = self.n_heads // self.n_kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        use_mask_call = (l > 1 and mask is not None) if FIXED else l > 1
        if use_mask_call:
            out = attention_from_ptr(q, k, v, self.scale, mask)
        else:
            out = causal_attention(q, k, v, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, l, -1))


class InternLM3DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = InternLM3Attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden_size, cfg.intermediate_size), nn.SiLU(),
                                 nn.Linear(cfg.intermediate_size, cfg.hidden_size))
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class InternLM3Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(InternLM3DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, caches, mask=None):
        # InternLM3Model::forward never builds a mask of its own: it passes the caller's through.
        h = self.embed_tokens(input_ids)
        for layer, c in zip(self.layers, caches):
            h = layer(h, mask, c)
        return self.lm_head(self.norm(h))


def generate(model, prompt, max_tokens):
    caches = [KVCache() for _ in model.layers]
    logits = model(prompt, caches, mask=None)  # generate.rs: None = "built-in causal mask"
    out = []
    tok = logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(max_tokens):
        out.append(int(tok))
        logits = model(tok, caches, mask=None)
        tok = logits[:, -1].argmax(-1, keepdim=True)
    return out, logits


if __name__ == "__main__":
    torch.manual_seed(0)
    cfg = InternLM3Config()
    model = InternLM3Model(cfg).eval()
    prompt = torch.tensor([[1, 17, 5, 42, 9, 33]])
    with torch.no_grad():
        toks, logits = generate(model, prompt, max_tokens=2)
    print("fixed" if FIXED else "buggy", toks, f"{logits[0, -1, :3].tolist()}")
