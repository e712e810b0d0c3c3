# ml-explore/mlx-lm#531: DeepSeek-V3.2 (DSA) Indexer picked top-k keys separately for each indexer head
# (no ReLU, no sum over heads), so each attention head group got its own sparse mask instead of one shared top-k.
# Ported from mlx to torch; tiny sizes.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class ModelArgs:
    hidden_size: int = 32
    num_attention_heads: int = 4
    q_lora_rank: int = 16
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 8
    qk_rope_head_dim: int = 4
    v_head_dim: int = 8
    index_n_heads: int = 2
    index_head_dim: int = 8
    index_topk: int = 4


class Indexer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.index_topk = args.index_topk
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.softmax_scale = self.head_dim ** -0.5

    def forward(self, x, qr, mask):
        b, s, _ = x.shape
        q = self.wq_b(qr).reshape(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.wk(x)).reshape(b, 1, s, self.head_dim)
        if k.shape[2] <= self.index_topk:
            return None
        weights = self.weights_proj(x) * (self.n_heads ** -0.5)
        weights = (weights * self.softmax_scale).transpose(-1, -2)[..., None]
        if FIXED:
            scores = q @ k.transpose(-1, -2)
            scores = torch.clamp(scores, min=0)
            scores = scores * weights
            scores = scores.sum(dim=1)  # (b, s, k): one selection shared by all heads
        else:
            scores = (q * weights) @ k.transpose(-1, -2)  # (b, n_heads, s, k)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.topk(self.index_topk, dim=-1).indices


class DeepseekV32Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.scale = self.q_head_dim ** -0.5
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_layernorm = nn.RMSNorm(config.q_lora_rank, eps=1e-6)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, config.hidden_size, bias=False)
        self.indexer = Indexer(config)

    def forward(self, x, mask=None):
        B, L, _ = x.shape
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(qr).reshape(B, L, self.num_heads, self.q_head_dim).transpose(1, 2)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        compressed_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(1, 2)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed_kv)).reshape(B, L, self.num_heads, -1).transpose(1, 2)
        k_nope, values = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        keys = torch.cat([k_nope, k_pe.expand(B, self.num_heads, L, -1)], dim=-1)
        queries = torch.cat([q_nope, q_pe], dim=-1)

        topk_indices = self.indexer(x, qr, mask)
        if topk_indices is not None:
            if FIXED:
                k_seq = keys.shape[2]
                sparse_mask = torch.zeros(B, L, k_seq, dtype=torch.bool)
                sparse_mask.scatter_(-1, topk_indices, True)
                sparse_mask = sparse_mask[:, None, :, :]
                if mask is not None:
                    sparse_mask = sparse_mask & mask
                mask = sparse_mask
            else:
                repeats = self.num_heads // self.config.index_n_heads
                topk_mask = torch.zeros(B, self.config.index_n_heads, *mask.shape[-2:], dtype=torch.bool)
                topk_mask.scatter_(-1, topk_indices, True)
                mask = mask & topk_mask
                mask = mask.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


def main():
    torch.manual_seed(0)
    args = ModelArgs()
    attn = DeepseekV32Attention(args).eval()
    T = 12
    x = torch.randn(1, T, args.hidden_size)
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # (L, K) causal mask, as create_attention_mask gives
    with torch.no_grad():
        out = attn(x, mask=causal)
        # reference, written out by hand: one top-k per query shared by every head
        ix = attn.indexer
        qr = attn.q_a_layernorm(attn.q_a_proj(x))
        q = ix.wq_b(qr).reshape(1, T, ix.n_heads, ix.head_dim).transpose(1, 2)
        k = ix.k_norm(ix.wk(x)).reshape(1, 1, T, ix.head_dim)
        w = (ix.weights_proj(x) * ix.n_heads ** -0.5 * ix.softmax_scale).transpose(-1, -2)[..., None]
        s = ((q @ k.transpose(-1, -2)).clamp(min=0) * w).sum(1).masked_fill(~causal, float("-inf"))
        sel = torch.zeros(1, T, T, dtype=torch.bool).scatter_(-1, s.topk(ix.index_topk, -1).indices, True)
        allowed = sel & causal
        qq = attn.q_b_proj(qr).reshape(1, T, attn.num_heads, -1).transpose(1, 2)
        ckv, kpe = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, attn.qk_rope_head_dim], -1)
        kv = attn.kv_b_proj(attn.kv_a_layernorm(ckv)).reshape(1, T, attn.num_heads, -1).transpose(1, 2)
        kn, v = kv.split([attn.qk_nope_head_dim, attn.v_head_dim], -1)
        kk = torch.cat([kn, kpe[:, None].expand(1, attn.num_heads, T, -1)], -1)
        logits = (qq @ kk.transpose(-1, -2)) * attn.scale
        ref = logits.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v
        ref = attn.o_proj(ref.transpose(1, 2).reshape(1, T, -1))
    print(f"mode={'fixed' if FIXED else 'buggy'} max|out - shared-top-k reference| = {(out - ref).abs().max():.4e}")


if __name__ == "__main__":
    main()
