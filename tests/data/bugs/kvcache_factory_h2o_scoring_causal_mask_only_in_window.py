"""KVCache-Factory H2O: the heavy-hitter scoring attention is causal only inside the last window.

Zefan-Cai/KVCache-Factory#49, fixed by commit 9f9aa2e ("Fix H2O causal masking").
`H2OKVCluster.update_kv` scores prompt tokens with softmax(q @ k.T / sqrt(d) + mask) over the whole
prompt, but the causal mask is built as (window_size, window_size) and added only to the bottom-right
block, so every query before the window attends to future keys. Fix: a (q_len, q_len) causal mask
added to all of attn_weights. Tiny llama-style layer: prefill, H2O compression, then decode.
"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class H2OKVCluster:
    def __init__(self, window_size=4, max_capacity_prompt=12):
        self.window_size = window_size
        self.max_capacity_prompt = max_capacity_prompt

    def update_kv(self, key_states, query_states, value_states):
        bsz, num_heads, q_len, head_dim = query_states.shape
        if q_len < self.max_capacity_prompt:
            return key_states, value_states
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
        if FIXED:
            mask = torch.full((q_len, q_len), torch.finfo(attn_weights.dtype).min)
        else:
            mask = torch.full((self.window_size, self.window_size), torch.finfo(attn_weights.dtype).min)
        mask_cond = torch.arange(mask.size(-1))
        mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
        attention_mask = mask[None, None, :, :]
        if FIXED:
            attn_weights += attention_mask
        else:
            attn_weights[:, :, -self.window_size:, -self.window_size:] += attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_weights_sum = attn_weights[:, :, :, : -self.window_size].sum(dim=-2)
        indices = attn_weights_sum.topk(self.max_capacity_prompt - self.window_size, dim=-1).indices
        self.kept = indices
        indices = indices.unsqueeze(-1).expand(-1, -1, -1, head_dim)
        k_past_compress = key_states[:, :, : -self.window_size, :].gather(dim=2, index=indices)
        v_past_compress = value_states[:, :, : -self.window_size, :].gather(dim=2, index=indices)
        k_cur = key_states[:, :, -self.window_size:, :]
        v_cur = value_states[:, :, -self.window_size:, :]
        return torch.cat([k_past_compress, k_cur], dim=2), torch.cat([v_past_compress, v_cur], dim=2)


class LlamaAttention(nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.kv_cluster = H2OKVCluster()
        self.past = None

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = (p(x).view(B, L, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.past is None:  # prefill: full causal attention, cache the compressed K/V
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            self.past = self.kv_cluster.update_kv(k, q, v)
        else:
            k = torch.cat([self.past[0], k], dim=2)
            v = torch.cat([self.past[1], v], dim=2)
            self.past = (k, v)
            out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


def reference_kept(attn, x):
    # heavy hitters accumulated with a causal mask over the whole prompt
    B, L, _ = x.shape
    q = attn.q_proj(x).view(B, L, attn.heads, -1).transpose(1, 2)
    k = attn.k_proj(x).view(B, L, attn.heads, -1).transpose(1, 2)
    w = (q @ k.transpose(2, 3) / math.sqrt(attn.head_dim)).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    s = w.softmax(-1)[:, :, :, : -attn.kv_cluster.window_size].sum(-2)
    return s.topk(attn.kv_cluster.max_capacity_prompt - attn.kv_cluster.window_size, dim=-1).indices


def main():
    attn = LlamaAttention().eval()
    prompt = torch.randn(1, 24, 32)
    with torch.no_grad():
        attn(prompt)
        ref = reference_kept(attn, prompt)
        same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(attn.kv_cluster.kept[0], ref[0]))
        total = ref[0].numel()
        y = attn(torch.randn(1, 1, 32))
    print(f"kept heavy hitters matching causal scoring: {same}/{total}; decode out norm {y.norm():.4f}")


if __name__ == "__main__":
    main()
