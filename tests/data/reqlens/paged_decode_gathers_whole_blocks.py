"""A vLLM-v1-style paged attention backend whose torch fallback gathers each request's whole blocks.

Written for maskcli's tests (checks/reqlens.py), in the layout of vLLM v1's FlashAttention backend: the model runner
builds one `FlashAttentionMetadata` per step (`query_start_loc`, `seq_lens`, `block_table`, `slot_mapping`) and the
backend hands it, with the paged cache, to `flash_attn_varlen_func(..., cu_seqlens_q=query_start_loc,
seqused_k=seq_lens, block_table=block_table, causal=True)`. The kernel is replaced by a torch fallback that loops over
the requests. Its bug (the kind hand-written paged fallbacks have): it gathers every slot of a request's blocks and
ignores `seqused_k`, so a request whose last block is not full attends the stale slots a freed request left there.
Fixed: the gathered keys are cut to `seqused_k[i]`.

Step 1 prefills request 0 (6 tokens, blocks 3 and 1 of 4 slots: block 1 half full, its other slots holding a freed
request's keys) beside request 1 (3 tokens); step 2 is a mixed batch: request 0 decodes one token, request 2 prefills 5.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
BLOCK = 4


@dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, seqused_k, block_table, softmax_scale, causal=True):
    """Torch fallback of the paged varlen kernel: per request, its queries against its blocks' keys."""
    out = torch.empty_like(q)
    for i in range(block_table.shape[0]):
        start, end = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        blocks = block_table[i][block_table[i] >= 0]
        keys = k[blocks].flatten(0, 1)  # (blocks * BLOCK, heads, dim)
        values = v[blocks].flatten(0, 1)
        if FIXED:
            keys, values = keys[: int(seqused_k[i])], values[: int(seqused_k[i])]
        q_len, k_len = end - start, keys.shape[0]
        mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len) if causal else None
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
            scale=softmax_scale).transpose(0, 1)
    return out


class FlashAttentionImpl:
    def __init__(self, num_heads, head_size, scale):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: FlashAttentionMetadata):
        key_cache, value_cache = kv_cache.unbind(0)
        n = attn_metadata.num_actual_tokens
        key_cache.flatten(0, 1)[attn_metadata.slot_mapping] = key[:n]
        value_cache.flatten(0, 1)[attn_metadata.slot_mapping] = value[:n]
        return flash_attn_varlen_func(
            query[:n], key_cache, value_cache, cu_seqlens_q=attn_metadata.query_start_loc,
            seqused_k=attn_metadata.seq_lens, block_table=attn_metadata.block_table, softmax_scale=self.scale,
            causal=True)


class Attention(torch.nn.Module):
    def __init__(self, hidden, num_heads):
        super().__init__()
        self.num_heads, self.head_size = num_heads, hidden // num_heads
        self.qkv_proj = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.impl = FlashAttentionImpl(num_heads, self.head_size, self.head_size ** -0.5)

    def forward(self, hidden_states, kv_cache, attn_metadata):
        q, k, v = self.qkv_proj(hidden_states).view(-1, 3, self.num_heads, self.head_size).unbind(1)
        return self.impl.forward(self, q, k, v, kv_cache, attn_metadata).flatten(1)


def metadata(query_lens, seq_lens, tables):
    """The runner's metadata of one step: each request's new tokens at the end of its seq_lens positions."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = [tables[i][p // BLOCK] * BLOCK + p % BLOCK
             for i, (q, s) in enumerate(zip(query_lens, seq_lens)) for p in range(s - q, s)]
    width = max(len(t) for t in tables)
    return FlashAttentionMetadata(
        num_actual_tokens=starts[-1], max_query_len=max(query_lens), query_start_loc=torch.tensor(starts),
        max_seq_len=max(seq_lens), seq_lens=torch.tensor(seq_lens),
        block_table=torch.tensor([t + [-1] * (width - len(t)) for t in tables]), slot_mapping=torch.tensor(slots))


def main():
    torch.manual_seed(0)
    hidden, heads = 16, 2
    attn = Attention(hidden, heads)
    kv_cache = torch.randn(2, 8, BLOCK, heads, hidden // heads)  # a freed request's keys still in every slot
    with torch.no_grad():
        attn(torch.randn(9, hidden), kv_cache, metadata([6, 3], [6, 3], [[3, 1], [5]]))
        out = attn(torch.randn(6, hidden), kv_cache, metadata([1, 5], [7, 5], [[3, 1], [0, 6]]))
    print("fixed" if FIXED else "buggy", "step 2 checksum:", round(out.sum().item(), 4))


if __name__ == "__main__":
    main()
