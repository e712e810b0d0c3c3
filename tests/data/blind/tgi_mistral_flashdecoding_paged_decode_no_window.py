"""TGI Mistral decode under flashdecoding: paged attention ignores the sliding window.

Citation: huggingface/text-generation-inference#3112 ("Bug Fix: Sliding Window
Attention", merged as a35fbdb9; the attention change is commit ff82f0f8
"(fix) sliding window attention"), read in the upstream git history.

Bug: `MistralAttention` keeps `self.max_past = config.sliding_window` and
passes `window_size_left=self.max_past` to `attention(...)` for prefill, but
the decode branch called `paged_attention(query, kv_cache, ..., block_tables,
seqlen, max_s, kv_scales=...)` with no window, and `paged_attention`'s
flashdecoding path hard-coded `-1, -1` (window left/right) in
`flash_attn_2_cuda.varlen_fwd`. TGI keeps every block of the sequence in the
block table, so once a sequence is longer than the window each decode token
attends to keys older than `sliding_window`.

Fix: `paged_attention(..., window_size_left=-1)` parameter forwarded to
varlen_fwd (window right 0 when a window is set), and Mistral passes
`window_size_left=self.max_past`.

This program: TGI's Mistral attention layer, `Seqlen`, block tables and slot
mapping in plain torch; `flash_attn_2_cuda.varlen_fwd` is replaced by a torch
port of its paged varlen semantics (keys from the block table up to
cu_seqlen_k, causal aligned bottom-right, window_left keys before the query)
that calls `F.scaled_dot_product_attention`. Block size 4 instead of 256 to
keep it small. Two sequences (9 and 13 prompt tokens) prefilled, then one
decode step, sliding_window = 4.
"""
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

ATTENTION = "flashdecoding"
BLOCK_SIZE = 4


class MistralConfig:
    def __init__(self, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                 sliding_window=4, rope_theta=10000.0, vocab_size=50):
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.sliding_window = sliding_window
        self.rope_theta = rope_theta
        self.vocab_size = vocab_size


@dataclass
class Seqlen:
    input_lengths: torch.Tensor
    cache_lengths: torch.Tensor
    cu_seqlen_q: Optional[torch.Tensor]
    cu_seqlen_k: Optional[torch.Tensor]
    max_q: int
    max_k: int

    def __init__(self, input_lengths, cache_lengths, cu_seqlen_q=None, max_q=None, max_k=None):
        self.input_lengths = input_lengths
        self.cache_lengths = cache_lengths
        shape = self.input_lengths.shape
        if cu_seqlen_q is None:
            cu_seqlen_q = torch.arange(shape[0] + 1, dtype=torch.int32)
            max_q = 1
        cu_seqlen_k = torch.zeros(shape[-1] + 1, dtype=torch.int32)
        total = self.input_lengths + self.cache_lengths
        torch.cumsum(total, -1, out=cu_seqlen_k[1:])
        self.cu_seqlen_q = cu_seqlen_q
        self.cu_seqlen_k = cu_seqlen_k
        self.max_q = max_q
        self.max_k = max_k


class KVCache:
    def __init__(self, num_blocks, num_heads, head_size):
        self.key = torch.zeros(num_blocks, BLOCK_SIZE, num_heads, head_size)
        self.value = torch.zeros(num_blocks, BLOCK_SIZE, num_heads, head_size)

    def store(self, key, value, slots):
        self.key.view(-1, *self.key.shape[2:])[slots] = key
        self.value.view(-1, *self.value.shape[2:])[slots] = value


def varlen_fwd(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, softmax_scale,
               causal, window_left, window_right):
    """Torch port of flash_attn_2_cuda.varlen_fwd with a paged KV cache."""
    out = torch.empty_like(q)
    for b in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k_len = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        blocks = block_table[b, : (k_len + BLOCK_SIZE - 1) // BLOCK_SIZE].long()
        k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:k_len]
        v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:k_len]
        q_len = qe - qs
        qi = torch.arange(q_len).unsqueeze(1) + (k_len - q_len)
        kj = torch.arange(k_len).unsqueeze(0)
        mask = torch.ones(q_len, k_len, dtype=torch.bool)
        if causal:
            mask &= kj <= qi
        if window_left >= 0:
            mask &= kj >= qi - window_left
        groups = q.shape[1] // k.shape[1]
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1),
            k.transpose(0, 1).repeat_interleave(groups, 0),
            v.transpose(0, 1).repeat_interleave(groups, 0),
            attn_mask=mask,
            scale=softmax_scale,
        )
        out[qs:qe] = o.transpose(0, 1)
    return out


def attention(*, query, kv_cache, seqlen, block_tables, softmax_scale, window_size_left=-1):
    # Prefill: flash-attn varlen over the paged cache, window honoured.
    return varlen_fwd(query, kv_cache.key, kv_cache.value, seqlen.cu_seqlen_q, seqlen.cu_seqlen_k,
                      block_tables, softmax_scale, True, window_size_left, 0 if window_size_left >= 0 else -1)


def paged_attention(query, kv_cache, kv_head_mapping, softmax_scale, block_tables, seqlen, max_s,
                    *, window_size_left: Optional[int] = -1):
    if ATTENTION == "flashdecoding":
        if FIXED:
            window_size_right = -1 if window_size_left == -1 else 0
            return varlen_fwd(query, kv_cache.key, kv_cache.value, seqlen.cu_seqlen_q, seqlen.cu_seqlen_k,
                              block_tables, softmax_scale, True, window_size_left, window_size_right)
        return varlen_fwd(
            query, kv_cache.key, kv_cache.value, seqlen.cu_seqlen_q, seqlen.cu_seqlen_k,
            block_tables, softmax_scale,
            True,  # causal
            -1,  # Window_left
            -1,  # Window right
        )
    raise NotImplementedError(ATTENTION)


class MistralAttention(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.max_past = config.sliding_window if config.sliding_window is not None else -1
        self.num_heads = config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.head_size = self.hidden_size // self.num_heads
        self.softmax_scale = self.head_size ** -0.5
        self.num_key_value_heads = config.num_key_value_heads
        self.query_key_value = torch.nn.Linear(
            self.hidden_size, self.head_size * (self.num_heads + 2 * self.num_key_value_heads), bias=False
        )
        self.o_proj = torch.nn.Linear(self.num_heads * self.head_size, self.hidden_size, bias=False)
        self.num_groups = self.num_heads // self.num_key_value_heads
        self.kv_head_mapping = torch.arange(0, self.num_key_value_heads, dtype=torch.int32).repeat_interleave(
            self.num_groups
        )

    def forward(self, hidden_states, cu_seqlen_prefill, kv_cache, block_tables, slots, seqlen, max_s):
        qkv = self.query_key_value(hidden_states)
        query, kv = qkv.split(
            [self.head_size * self.num_heads, 2 * self.head_size * self.num_key_value_heads], dim=1
        )
        query = query.view(-1, self.num_heads, self.head_size)
        kv = kv.view(-1, 2, self.num_key_value_heads, self.head_size)
        kv_cache.store(key=kv[:, 0], value=kv[:, 1], slots=slots)

        # Prefill
        if cu_seqlen_prefill is not None:
            attn_output = attention(
                query=query, kv_cache=kv_cache, seqlen=seqlen, block_tables=block_tables,
                softmax_scale=self.softmax_scale, window_size_left=self.max_past,
            )
        # Decode
        else:
            if FIXED:
                attn_output = paged_attention(
                    query, kv_cache, self.kv_head_mapping, self.softmax_scale, block_tables, seqlen, max_s,
                    window_size_left=self.max_past,
                )
            else:
                attn_output = paged_attention(
                    query, kv_cache, self.kv_head_mapping, self.softmax_scale, block_tables, seqlen, max_s,
                )
        return self.o_proj(attn_output.view(-1, self.num_heads * self.head_size))


def slots_for(block_table, start, end):
    return [block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]


def main():
    torch.manual_seed(0)
    config = MistralConfig()
    layer = MistralAttention(config).eval()
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    kv_cache = KVCache(num_blocks=10, num_heads=config.num_key_value_heads, head_size=layer.head_size)

    prompt_lens = [9, 13]
    block_tables = torch.tensor([[5, 2, 7, 0], [1, 8, 3, 6]], dtype=torch.int32)
    ids = [torch.randint(0, config.vocab_size, (n,)) for n in prompt_lens]

    with torch.no_grad():
        # Prefill both sequences in one batch.
        input_lengths = torch.tensor(prompt_lens, dtype=torch.int32)
        cu_seqlen_prefill = F.pad(torch.cumsum(input_lengths, 0), (1, 0)).int()
        seqlen = Seqlen(input_lengths, torch.zeros(2, dtype=torch.int32), cu_seqlen_q=cu_seqlen_prefill,
                        max_q=max(prompt_lens), max_k=max(prompt_lens))
        slots = torch.tensor(sum((slots_for(block_tables[i].tolist(), 0, n) for i, n in enumerate(prompt_lens)), []))
        layer(embed(torch.cat(ids)), cu_seqlen_prefill, kv_cache, block_tables, slots, seqlen, max(prompt_lens))

        # One decode step: each sequence feeds its next token.
        next_ids = torch.randint(0, config.vocab_size, (2,))
        cache_lengths = torch.tensor(prompt_lens, dtype=torch.int32)
        seqlen = Seqlen(torch.ones(2, dtype=torch.int32), cache_lengths, max_k=max(prompt_lens) + 1)
        slots = torch.tensor([slots_for(block_tables[i].tolist(), n, n + 1)[0] for i, n in enumerate(prompt_lens)])
        out = layer(embed(next_ids), None, kv_cache, block_tables, slots, seqlen, max(prompt_lens) + 1)
    print("fixed" if FIXED else "buggy", "decode output checksum:", round(out.sum().item(), 4))


if __name__ == "__main__":
    main()
