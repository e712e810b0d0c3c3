"""hyprstream Llama runtime: cached multi-token forward builds its causal mask as tril(0) on [q_len, kv_len].

Citation: hyprstream/hyprstream#1521, "fix(runtime): offset causal mask by cached KV length in
multi-token forwards" (merged). I read the PR description, not the Rust diff; the code below is a
torch port written from that description, keeping the runtime's names (LlamaModel, start_pos,
q_len, kv_len).

Bug: llama.rs built the causal mask as `tril(0)` on a `[q_len, kv_len]` ones matrix. That is right
only when kv_len == q_len (a fresh prefill). For a cached multi-token forward (kv_len = start_pos +
q_len: a prefix-cache hit with a >= 2-token suffix, or a speculative verify chunk) query row i kept
only keys j <= i, so the whole cached prompt history was masked out.

Fix: offset the diagonal by `kv_len - q_len` (tril(kv_len - q_len)).

Reproduction: a 1-layer Llama-style model with a per-layer KV cache; a 5-token prefill at
start_pos 0, then a 3-token cached forward at start_pos 5 (kv_len 8). The mask is handed to
F.scaled_dot_product_attention as an additive float mask.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class LlamaConfig:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 1
    max_position_embeddings = 64
    rope_theta = 10000.0


def rope(x, positions, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def causal_mask(q_len, kv_len, dtype):
    """The runtime's mask builder for multi-token forwards (seq_len > 1)."""
    ones = torch.ones(q_len, kv_len)
    if FIXED:
        keep = torch.tril(ones, diagonal=kv_len - q_len)
    else:
        keep = torch.tril(ones, diagonal=0)
    mask = torch.zeros(q_len, kv_len, dtype=dtype)
    return mask.masked_fill(keep == 0, float("-inf"))


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.cache_k = None
        self.cache_v = None

    def forward(self, x, start_pos, mask):
        b, q_len, _ = x.shape
        q = self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, q_len, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, q_len, self.n_heads, self.head_dim).transpose(1, 2)
        pos = torch.arange(start_pos, start_pos + q_len)
        q, k = rope(q, pos, self.theta), rope(k, pos, self.theta)
        if self.cache_k is not None:
            k = torch.cat([self.cache_k, k], dim=2)
            v = torch.cat([self.cache_v, v], dim=2)
        self.cache_k, self.cache_v = k, v
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden_size, 64), nn.SiLU(), nn.Linear(64, cfg.hidden_size))

    def forward(self, x, start_pos, mask):
        x = x + self.self_attn(self.input_layernorm(x), start_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, start_pos=0):
        h = self.embed_tokens(input_ids)
        q_len = input_ids.shape[1]
        kv_len = start_pos + q_len
        mask = causal_mask(q_len, kv_len, h.dtype) if q_len > 1 else None
        for layer in self.layers:
            h = layer(h, start_pos, mask)
        return self.lm_head(self.norm(h))


def main():
    torch.manual_seed(0)
    cfg = LlamaConfig()
    model = LlamaModel(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 5))
    suffix = torch.randint(0, cfg.vocab_size, (1, 3))
    with torch.no_grad():
        model(prompt, start_pos=0)
        logits = model(suffix, start_pos=prompt.shape[1])
    print("suffix next tokens:", logits.argmax(-1).tolist())


if __name__ == "__main__":
    main()
