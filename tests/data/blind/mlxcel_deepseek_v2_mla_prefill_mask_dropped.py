# lablup/mlxcel#991, fixed by lablup/mlxcel#998: deepseek_v2 MLAAttention ran prompt prefill (L > 1) with the
# caller's mask, which every generation path leaves as None, so the prefill was bidirectional; only the L == 1
# (absorbed, latent-cache) decode branch was "causal". Ported from Rust to torch; tiny sizes.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Config:
    vocab_size = 64
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 2
    kv_lora_rank = 16
    qk_nope_head_dim = 8
    qk_rope_head_dim = 4
    v_head_dim = 8
    rope_theta = 10000.0


def rope(x, offset, theta):
    d = x.shape[-1]
    pos = torch.arange(offset, offset + x.shape[-2], dtype=torch.float32)
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def create_causal_mask(L, offset):
    q = torch.arange(offset, offset + L)[:, None]
    k = torch.arange(offset + L)[None]
    return k <= q


class MLACache:
    def __init__(self):
        self.latent, self.k_pe, self.offset = None, None, 0

    def update_and_fetch(self, latent, k_pe):
        if self.latent is None:
            self.latent, self.k_pe = latent, k_pe
        else:
            self.latent = torch.cat([self.latent, latent], 1)
            self.k_pe = torch.cat([self.k_pe, k_pe], 2)
        self.offset += latent.shape[1]
        return self.latent, self.k_pe


class MLAAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c, self.h = c, c.num_attention_heads
        self.nope, self.rope_d, self.v_d, self.r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        self.scale = (self.nope + self.rope_d) ** -0.5
        self.q_proj = nn.Linear(c.hidden_size, self.h * (self.nope + self.rope_d), bias=False)  # V2-Lite: q_lora_rank null
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, self.r + self.rope_d, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(self.r, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.r, self.h * (self.nope + self.v_d), bias=False)
        self.o_proj = nn.Linear(self.h * self.v_d, c.hidden_size, bias=False)

    def causal_attention(self, q_nope, q_pe, latent, k_pe):
        # absorbed decode: queries move into the latent space, attention runs over the latent cache
        w = self.kv_b_proj.weight.view(self.h, self.nope + self.v_d, self.r)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]
        q_lat = q_nope @ w_uk  # (B, H, L, r)
        B, _, L, _ = q_lat.shape
        S = latent.shape[1]
        query = torch.cat([q_lat, q_pe], -1)
        key = torch.cat([latent[:, None].expand(B, self.h, S, self.r), k_pe.expand(B, self.h, S, self.rope_d)], -1)
        mask = create_causal_mask(L, S - L)  # a single query sees the whole cache
        o_lat = F.scaled_dot_product_attention(query, key, latent[:, None].expand(B, self.h, S, self.r), attn_mask=mask, scale=self.scale)
        return o_lat @ w_uv.transpose(-1, -2)

    def forward(self, x, mask, cache):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.h, -1).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope_d], -1)
        compressed_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.r, self.rope_d], -1)
        latent = self.kv_a_layernorm(compressed_kv)
        k_pe = k_pe.view(B, L, 1, self.rope_d).transpose(1, 2)
        q_pe, k_pe = rope(q_pe, cache.offset, self.c.rope_theta), rope(k_pe, cache.offset, self.c.rope_theta)
        latent, k_pe = cache.update_and_fetch(latent, k_pe)
        if L == 1:
            out = self.causal_attention(q_nope, q_pe, latent, k_pe)
        else:
            S = latent.shape[1]
            kv = self.kv_b_proj(latent).view(B, S, self.h, -1).transpose(1, 2)
            k_nope, values = kv.split([self.nope, self.v_d], -1)
            keys = torch.cat([k_nope, k_pe.expand(B, self.h, S, self.rope_d)], -1)
            queries = torch.cat([q_nope, q_pe], -1)
            if FIXED and mask is None:
                mask = create_causal_mask(L, S - L)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=1e-6)
        self.self_attn = MLAAttention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(c.hidden_size, 64), nn.SiLU(), nn.Linear(64, c.hidden_size))

    def forward(self, x, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV2Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = nn.RMSNorm(c.hidden_size, eps=1e-6)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, ids, cache, mask=None):
        h = self.embed_tokens(ids)
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, mask, layer_cache)
        return self.lm_head(self.norm(h))


def main():
    torch.manual_seed(0)
    c = Config()
    model = DeepseekV2Model(c).eval()
    ids = torch.randint(0, c.vocab_size, (1, 6))
    with torch.no_grad():
        cache = [MLACache() for _ in range(c.num_hidden_layers)]
        prefill = model(ids, cache)  # generate(): prompt prefill with mask=None
        nxt = prefill[:, -1].argmax(-1, keepdim=True)
        step = model(nxt, cache)  # one decode step on the latent cache
        # reference: feed the prompt one token at a time (each step only has the past in its cache)
        ref_cache = [MLACache() for _ in range(c.num_hidden_layers)]
        ref = torch.cat([model(ids[:, t: t + 1], ref_cache) for t in range(ids.shape[1])], 1)
    print(f"mode={'fixed' if FIXED else 'buggy'} max|prefill logits - token-by-token logits| = "
          f"{(prefill - ref).abs().max():.4e}; decode token after prompt: {step.argmax(-1).item()}")


if __name__ == "__main__":
    main()
