"""Prefix-cached prefill over a shared system prompt, vLLM style, with bottom-right-aligned causal masks.

Follows vLLM's prefix caching (vllm/core/block/prefix_caching_block.py computes which full blocks of a
prompt are already cached; the attention backend then runs flash_attn_varlen_func with
cu_seqlens_q over the *new* tokens only, cu_seqlens_k over cached + new tokens and causal=True, which
flash-attn aligns to the bottom-right corner). Here the varlen kernel is replaced by per-request
F.scaled_dot_product_attention with torch.nn.attention.bias.causal_lower_right, the same convention.

Mask meant: request r has P_r cached prefix tokens (a multiple of block_size) and Q_r new tokens; new
query i (absolute position P_r + i) sees keys 0 .. P_r + i. The query block is shorter than the key
block on purpose: the cached prefix is visible to every new query.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

torch.manual_seed(0)

BLOCK_SIZE = 4
NUM_HEADS = 2
HEAD_DIM = 8


@dataclass
class PrefillMetadata:
    """What the scheduler hands to the attention backend for one prefill step."""

    query_start_loc: torch.Tensor  # cu_seqlens_q over new tokens
    seq_start_loc: torch.Tensor  # cu_seqlens_k over cached + new tokens
    num_computed_tokens: list  # cached prefix length per request


def cached_prefix_len(prompt_len, shared_len):
    # only whole blocks are hashed and reused; the last partial block is recomputed
    # and at least one token must be computed to produce logits
    n = (min(shared_len, prompt_len - 1) // BLOCK_SIZE) * BLOCK_SIZE
    return n


def forward_prefill(q, k_all, v_all, meta):
    out = torch.empty_like(q)
    for r in range(len(meta.num_computed_tokens)):
        qs, qe = meta.query_start_loc[r].item(), meta.query_start_loc[r + 1].item()
        ks, ke = meta.seq_start_loc[r].item(), meta.seq_start_loc[r + 1].item()
        qr = q[qs:qe].transpose(0, 1).unsqueeze(0)
        kr = k_all[ks:ke].transpose(0, 1).unsqueeze(0)
        vr = v_all[ks:ke].transpose(0, 1).unsqueeze(0)
        bias = causal_lower_right(qe - qs, ke - ks)
        o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=bias)
        out[qs:qe] = o.squeeze(0).transpose(0, 1)
    return out


def main():
    system_prompt_len = 9
    prompt_lens = [13, 11, 17]
    d = NUM_HEADS * HEAD_DIM
    wqkv = torch.randn(d, 3 * d) / d ** 0.5
    shared = torch.randn(system_prompt_len, d)
    prompts = [torch.cat([shared, torch.randn(n - system_prompt_len, d)]) for n in prompt_lens]

    # KV of the cached blocks already sits in the cache from an earlier request
    computed = [cached_prefix_len(n, system_prompt_len) for n in prompt_lens]
    new_tokens = [p[c:] for p, c in zip(prompts, computed)]
    q_lens = [t.shape[0] for t in new_tokens]
    meta = PrefillMetadata(
        query_start_loc=torch.tensor([0] + q_lens).cumsum(0),
        seq_start_loc=torch.tensor([0] + prompt_lens).cumsum(0),
        num_computed_tokens=computed,
    )

    q_new, k_all, v_all = [], [], []
    for p, c in zip(prompts, computed):
        qkv = (p @ wqkv).view(-1, 3, NUM_HEADS, HEAD_DIM)
        q_new.append(qkv[c:, 0])
        k_all.append(qkv[:, 1])  # cached blocks + freshly written slots
        v_all.append(qkv[:, 2])
    out = forward_prefill(torch.cat(q_new), torch.cat(k_all), torch.cat(v_all), meta)

    # without the cache: full causal prefill, keep only the rows that were recomputed
    for r, p in enumerate(prompts):
        qkv = (p @ wqkv).view(-1, 3, NUM_HEADS, HEAD_DIM).permute(1, 2, 0, 3)
        full = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True).transpose(0, 1)
        qs, qe = meta.query_start_loc[r].item(), meta.query_start_loc[r + 1].item()
        assert torch.allclose(out[qs:qe], full[computed[r]:], atol=1e-5)
    print("cached prefix tokens per request:", computed, "new tokens:", q_lens)


if __name__ == "__main__":
    main()
