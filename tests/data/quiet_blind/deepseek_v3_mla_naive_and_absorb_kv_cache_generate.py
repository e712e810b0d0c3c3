"""DeepSeek-V3 inference MLA: multi-head latent attention, "naive" and "absorb" paths, with a KV cache.

Follows deepseek-ai/DeepSeek-V3 inference/model.py (ModelArgs dataclass, MLA.forward with attn_impl "naive"
caching full k/v and "absorb" caching the normalised latent kv_cache plus pe_cache and folding wkv_b into the
query; Transformer.forward builds ``torch.full((seqlen, seqlen), -inf).triu_(1)`` only when seqlen > 1 and passes
mask=None for one-token decode steps; scores += mask.unsqueeze(1)) and inference/generate.py (prompt prefill at
start_pos 0, then one token per step at start_pos = prev_pos). Dense MLP instead of MoE; no YaRN scaling.
Mask meant: causal over the prompt during prefill; a decode token sees every cached position (all are in its past).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    max_batch_size: int = 2
    max_seq_len: int = 32
    vocab_size: int = 64
    dim: int = 64
    inter_dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rope_theta: float = 10000.0


attn_impl = "absorb"


def precompute_freqs_cis(args):
    dim = args.qk_rope_head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    t = torch.arange(args.max_seq_len)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(x, freqs_cis):
    dtype = x.dtype
    x = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, x.size(1), 1, x.size(-1))
    y = torch.view_as_real(x * freqs_cis).flatten(3)
    return y.to(dtype)


class MLA(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_local_heads = args.n_heads
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        self.v_head_dim = args.v_head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_lora_rank)
        self.wkv_b = nn.Linear(self.kv_lora_rank, args.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)
        self.softmax_scale = self.qk_head_dim ** -0.5
        B, S, H = args.max_batch_size, args.max_seq_len, args.n_heads
        if attn_impl == "naive":
            self.register_buffer("k_cache", torch.zeros(B, S, H, self.qk_head_dim), persistent=False)
            self.register_buffer("v_cache", torch.zeros(B, S, H, self.v_head_dim), persistent=False)
        else:
            self.register_buffer("kv_cache", torch.zeros(B, S, self.kv_lora_rank), persistent=False)
            self.register_buffer("pe_cache", torch.zeros(B, S, self.qk_rope_head_dim), persistent=False)

    def forward(self, x, start_pos, freqs_cis, mask):
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        q = self.wq(x).view(bsz, seqlen, self.n_local_heads, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, freqs_cis)
        kv = self.wkv_a(x)
        kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis)
        if attn_impl == "naive":
            q = torch.cat([q_nope, q_pe], dim=-1)
            kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, self.n_local_heads, self.qk_nope_head_dim + self.v_head_dim)
            k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_local_heads, -1)], dim=-1)
            self.k_cache[:bsz, start_pos:end_pos] = k
            self.v_cache[:bsz, start_pos:end_pos] = v
            scores = torch.einsum("bshd,bthd->bsht", q, self.k_cache[:bsz, :end_pos]) * self.softmax_scale
        else:
            wkv_b = self.wkv_b.weight.view(self.n_local_heads, -1, self.kv_lora_rank)
            q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :self.qk_nope_head_dim])
            self.kv_cache[:bsz, start_pos:end_pos] = self.kv_norm(kv)
            self.pe_cache[:bsz, start_pos:end_pos] = k_pe.squeeze(2)
            scores = (torch.einsum("bshc,btc->bsht", q_nope, self.kv_cache[:bsz, :end_pos]) +
                      torch.einsum("bshr,btr->bsht", q_pe, self.pe_cache[:bsz, :end_pos])) * self.softmax_scale
        if mask is not None:
            scores += mask.unsqueeze(1)
        scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        if attn_impl == "naive":
            x = torch.einsum("bsht,bthd->bshd", scores, self.v_cache[:bsz, :end_pos])
        else:
            x = torch.einsum("bsht,btc->bshc", scores, self.kv_cache[:bsz, :end_pos])
            x = torch.einsum("bshc,hdc->bshd", x, wkv_b[:, -self.v_head_dim:])
        return self.wo(x.flatten(2))


class Block(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attn = MLA(args)
        self.ffn = nn.Sequential(nn.Linear(args.dim, args.inter_dim), nn.SiLU(), nn.Linear(args.inter_dim, args.dim))
        self.attn_norm, self.ffn_norm = nn.RMSNorm(args.dim), nn.RMSNorm(args.dim)

    def forward(self, x, start_pos, freqs_cis, mask):
        x = x + self.attn(self.attn_norm(x), start_pos, freqs_cis, mask)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([Block(args) for _ in range(args.n_layers)])
        self.norm = nn.RMSNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args), persistent=False)

    @torch.inference_mode()
    def forward(self, tokens, start_pos=0):
        seqlen = tokens.size(1)
        h = self.embed(tokens)
        freqs_cis = self.freqs_cis[start_pos:start_pos + seqlen]
        mask = None
        if seqlen > 1:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device).triu_(1)
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        return self.head(self.norm(h)[:, -1])


def generate(model, prompt, max_new_tokens):
    tokens, prev_pos = prompt, 0
    for _ in range(max_new_tokens):
        logits = model.forward(tokens[:, prev_pos:], prev_pos)
        prev_pos = tokens.size(1)
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens


def build(impl):
    global attn_impl
    attn_impl = impl
    torch.manual_seed(0)
    return Transformer(ModelArgs()).eval()


def main():
    torch.manual_seed(1)
    prompt = torch.randint(0, 64, (2, 6))
    # attn_impl is module-global, as upstream: run each implementation right after building it
    naive = build("naive")
    out_naive = generate(naive, prompt, 4)
    absorb = build("absorb")
    out_absorb = generate(absorb, prompt, 4)
    assert torch.equal(out_absorb, out_naive)
    # recomputing the whole sequence from scratch (prefill only) predicts the same next token
    for n in range(6, out_absorb.size(1)):
        logits = absorb.forward(out_absorb[:, :n], 0)
        assert torch.equal(logits.argmax(-1), out_absorb[:, n])
    print("deepseek mla ok", out_absorb[:, 6:].tolist())


if __name__ == "__main__":
    main()
