"""sparkinfer: flash_prefill's causal bound ignores the cached prefix when seqlen_q != seqlen_kv.

Citation: gittensor-ai-lab/sparkinfer issue #3 ("kernels/attention: flash_prefill causal mask misaligns
query/key positions when seqlen_q != seqlen_kv") and its fix, PR #4 (merged). Both descriptions read;
the kernel is CUDA (kernels/csrc/cuda/attention/flash_prefill.cu), so the torch code below is a
reference port of the one line and of the engine around it, written from those descriptions.

Bug: `kv_end = causal ? min(seqlen_kv, qpos + 1) : seqlen_kv` aligns the causal frontier top-left.
For chunked prefill / a prefix-cache hit the query chunk is the tail of a longer KV sequence, so query
`qpos` sits at absolute position `qpos + (seqlen_kv - seqlen_q)`; the old bound hid the most recent
`seqlen_kv - seqlen_q` keys from every query of the chunk.

Fix: `kv_end = causal ? min(seqlen_kv, qpos + 1 + (seqlen_kv - seqlen_q)) : seqlen_kv`.

Reproduction: a paged KV cache (block_table, slot_mapping, block_size 4), one request with a 10-token
prompt prefilled in two chunks (6 then 4 tokens, `max_num_batched_tokens = 6`); the second chunk runs
`flash_prefill` with seqlen_q 4 and seqlen_kv 10. Per query the kernel port gathers keys [0, kv_end)
and runs a softmax over q @ k^T.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


@dataclass
class AttentionMetadata:
    seqlen_q: int
    seqlen_kv: int
    block_table: torch.Tensor   # [num_blocks_for_seq]
    slot_mapping: torch.Tensor  # [seqlen_q] slots the new tokens' K/V are written to
    causal: bool = True


class PagedKVCache:
    def __init__(self, num_blocks, block_size, num_heads, head_dim):
        self.block_size = block_size
        self.k = torch.zeros(num_blocks * block_size, num_heads, head_dim)
        self.v = torch.zeros(num_blocks * block_size, num_heads, head_dim)

    def write(self, k, v, slot_mapping):
        self.k[slot_mapping] = k
        self.v[slot_mapping] = v

    def gather(self, block_table, seqlen_kv):
        pos = torch.arange(seqlen_kv)
        slots = block_table[pos // self.block_size] * self.block_size + pos % self.block_size
        return self.k[slots], self.v[slots]


def flash_prefill(q, k, v, seqlen_q, seqlen_kv, causal, scale):
    """Port of flash_prefill_kernel: query qpos attends keys [0, kv_end)."""
    out = torch.empty_like(q)
    for qpos in range(seqlen_q):
        if FIXED:
            kv_end = min(seqlen_kv, qpos + 1 + (seqlen_kv - seqlen_q)) if causal else seqlen_kv
        else:
            kv_end = min(seqlen_kv, qpos + 1) if causal else seqlen_kv
        scores = torch.einsum("hd,khd->hk", q[qpos], k[:kv_end]) * scale
        p = torch.softmax(scores, dim=-1)
        out[qpos] = torch.einsum("hk,khd->hd", p, v[:kv_end])
    return out


class Attention(nn.Module):
    def __init__(self, hidden, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x, kv_cache: PagedKVCache, md: AttentionMetadata):
        q, k, v = self.qkv_proj(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        kv_cache.write(k, v, md.slot_mapping)
        k_all, v_all = kv_cache.gather(md.block_table, md.seqlen_kv)
        o = flash_prefill(q, k_all, v_all, md.seqlen_q, md.seqlen_kv, md.causal,
                          self.head_dim ** -0.5)
        return self.o_proj(o.reshape(x.shape[0], -1))


def main():
    torch.manual_seed(0)
    hidden, heads, block_size, max_num_batched_tokens = 16, 2, 4, 6
    embed = nn.Embedding(32, hidden)
    attn = Attention(hidden, heads).eval()
    cache = PagedKVCache(num_blocks=8, block_size=block_size, num_heads=heads,
                         head_dim=hidden // heads)
    prompt = torch.randint(0, 32, (10,))
    block_table = torch.tensor([5, 2, 7])  # physical blocks handed out by the block manager
    num_computed = 0
    outs = []
    with torch.no_grad():
        while num_computed < prompt.numel():
            n = min(max_num_batched_tokens, prompt.numel() - num_computed)
            pos = torch.arange(num_computed, num_computed + n)
            slot_mapping = block_table[pos // block_size] * block_size + pos % block_size
            md = AttentionMetadata(seqlen_q=n, seqlen_kv=num_computed + n,
                                   block_table=block_table, slot_mapping=slot_mapping)
            outs.append(attn(embed(prompt[pos]), cache, md))
            num_computed += n
    out = torch.cat(outs)
    print("chunks", [o.shape[0] for o in outs], "out sum %.4f" % out.sum().item())


if __name__ == "__main__":
    main()
