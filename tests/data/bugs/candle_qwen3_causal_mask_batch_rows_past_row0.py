"""huggingface/candle#3582, fixed by huggingface/candle#3586 (merged): candle-transformers/src/models/qwen3.rs.

Ported from Rust to torch at tiny sizes. `Model::causal_mask(b, tgt, offset, sw)` fills one
(tgt, tgt + offset) additive mask -- tgt * (tgt + offset) values, whatever the batch -- and hands
it to `Tensor::from_slice(&mask, (b, 1, tgt, tgt + offset))`, which does not check the element
count against a fully given shape. Batch row 0 reads the mask; rows >= 1 read storage the slice
never filled (here: a zeroed buffer of the declared size, i.e. no -inf anywhere). The attention
adds the mask with `scores.broadcast_add(m)`.
Fix (#3586): the mask is shaped (1, 1, tgt, tgt + offset) and broadcast over the batch.

The run: a Qwen3 reranker/embedder style forward over a batch of two equal-length prompts (no
padding), last-token pooling, then one cached decode step.
"""
import sys
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Config:
    vocab_size: int = 96
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    max_position_embeddings: int = 64
    sliding_window: Optional[int] = None
    use_sliding_window: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        dim = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.register_buffer("cos", freqs.cos(), persistent=False)

    def apply(self, q, k, offset: int):
        # candle_nn::rotary_emb::rope (non-interleaved halves)
        l = q.shape[2]
        cos = self.cos[offset:offset + l]
        sin = self.sin[offset:offset + l]
        cos = torch.cat([cos, cos], -1)[None, None]
        sin = torch.cat([sin, sin], -1)[None, None]

        def rot(x):
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat([-x2, x1], -1)

        return q * cos + rot(q) * sin, k * cos + rot(k) * sin


class RmsNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(x, n_rep):
    if n_rep == 1:
        return x
    b, h, l, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, l, d).reshape(b, h * n_rep, l, d)


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Config, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.num_kv_groups = self.num_heads // self.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RmsNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RmsNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary_emb = rotary
        self.kv_cache = None  # candle_nn::kv_cache::ConcatKvCache

    def forward(self, x, attn_mask: Optional[torch.Tensor], offset: int):
        b, l, _ = x.shape
        q = self.q_proj(x).view(b, l, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, l, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, l, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = self.q_norm(q)
        k = self.k_norm(k)
        q, k = self.rotary_emb.apply(q, k, offset)
        if self.kv_cache is not None:
            k = torch.cat([self.kv_cache[0], k], dim=2)
            v = torch.cat([self.kv_cache[1], v], dim=2)
        self.kv_cache = (k, v)
        k = repeat_kv(k, self.num_kv_groups)
        v = repeat_kv(v, self.num_kv_groups)
        scale = 1.0 / math.sqrt(self.head_dim)
        scores = (q @ k.transpose(-2, -1)) * scale
        if attn_mask is not None:
            scores = scores + attn_mask  # broadcast_add
        probs = torch.softmax(scores, dim=-1)
        ctx = probs @ v
        return self.o_proj(ctx.transpose(1, 2).reshape(b, l, -1))

    def clear_kv_cache(self):
        self.kv_cache = None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, rotary)
        self.mlp = Qwen3MLP(cfg)
        self.ln1 = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ln2 = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, mask, offset):
        h = self.self_attn(self.ln1(x), mask, offset)
        x = x + h
        return x + self.mlp(self.ln2(x))


def tensor_from_slice(data, shape):
    # Tensor::from_slice with a fully specified shape: the slice's length is not checked; the
    # storage is of the declared shape and only the slice's values are written into it.
    numel = 1
    for s in shape:
        numel *= s
    storage = torch.zeros(numel, dtype=torch.float32)
    n = min(len(data), numel)
    storage[:n] = torch.tensor(data[:n], dtype=torch.float32)
    return storage.view(*shape)


class Model(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList([DecoderLayer(cfg, rotary) for _ in range(cfg.num_hidden_layers)])
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def clear_kv_cache(self):
        for layer in self.layers:
            layer.self_attn.clear_kv_cache()

    def causal_mask(self, b: int, tgt: int, offset: int, sw: Optional[int]):
        minf = float("-inf")
        mask = []
        for i in range(tgt):
            for j in range(tgt + offset):
                past_ok = j <= i + offset
                sw_ok = True if sw is None else (i + offset) - j <= sw
                mask.append(0.0 if (past_ok and sw_ok) else minf)
        if FIXED:
            return tensor_from_slice(mask, (1, 1, tgt, tgt + offset))
        return tensor_from_slice(mask, (b, 1, tgt, tgt + offset))

    def forward(self, input_ids: torch.Tensor, offset: int):
        b, l = input_ids.shape
        h = self.embed_tokens(input_ids)
        sw = self.cfg.sliding_window if self.cfg.use_sliding_window else None
        causal = None if l == 1 else self.causal_mask(b, l, offset, sw)
        for layer in self.layers:
            h = layer(h, causal, offset)
        return self.norm(h)


class ModelForCausalLM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.base = Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, offset):
        h = self.base(input_ids, offset)
        return self.lm_head(h[:, -1:, :])

    def clear_kv_cache(self):
        self.base.clear_kv_cache()


def main():
    torch.manual_seed(0)
    cfg = Config()
    model = ModelForCausalLM(cfg).eval()

    # two equal-length prompts (a reranker batch: query + document, same token count)
    prompts = torch.tensor([
        [3, 17, 42, 8, 55, 23, 61, 9],
        [3, 17, 42, 8, 71, 30, 12, 88],
    ])

    with torch.no_grad():
        # embedding pass: last-token pooling over the batch
        model.clear_kv_cache()
        hidden = model.base(prompts, 0)
        emb = F.normalize(hidden[:, -1], dim=-1)
        print("embedding norms:", emb.norm(dim=-1).tolist())
        print("cosine(row0, row1): %.6f" % float(emb[0] @ emb[1]))

        # generation: prefill, then a few cached decode steps (greedy)
        model.clear_kv_cache()
        logits = model(prompts, 0)
        offset = prompts.shape[1]
        generated = []
        tok = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(4):
            generated.append(tok)
            logits = model(tok, offset)
            offset += 1
            tok = logits[:, -1].argmax(-1, keepdim=True)
        print("generated:", torch.cat(generated, 1).tolist())


if __name__ == "__main__":
    main()
