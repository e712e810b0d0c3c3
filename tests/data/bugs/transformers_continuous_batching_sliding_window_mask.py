"""transformers continuous batching: build_attention_mask got the sliding window backwards.

Citation: huggingface/transformers#41184 (issue "Continuous Batching sliding window attention mask is
wrong", 2025-09-27) fixed by huggingface/transformers#41228 ("Fix sliding window attn mask", merged).

Bug: in `generation/continuous_batching/continuous_api.py::build_attention_mask` the sliding part was
    sliding_diagonal = seqlen_k - seqlen_q + sliding_window
    masked = torch.tril(masked, diagonal=sliding_diagonal)
i.e. it *zeroed* the causal -inf entries above `seqlen_k - seqlen_q + sliding_window`, so a query saw
future keys more than `sliding_window` ahead and every old key behind it (the issue shows more keys
left visible with the window than without).
Fix (#41228 diff):
    sliding_diagonal = seqlen_k - seqlen_q - sliding_window
    masked += torch.tril(minus_inf, diagonal=sliding_diagonal)

The sliding lines (buggy and fixed) are from the PR's review diff; the rest of `build_attention_mask`
(the causal diagonal) is written from my memory of continuous_api.py at that time.

This program: a packed ("paged") continuous batch as the CB processor builds it -- cumulative_seqlens_q
/ cumulative_seqlens_k over three requests (a fresh 10-token prefill, a decode step over 8 cached
tokens, and a 4-token chunk continuing a 9-token prefill) -- and one `sdpa_paged`-style attention call
over the packed queries and keys with the resulting 4D mask. The window comes from the model config.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


def build_attention_mask(attention_mask, cumulative_seqlens_q, cumulative_seqlens_k, sliding_window=1):
    """Fill the per-request diagonal blocks of the packed mask (causal, optionally sliding)."""
    min_value = torch.finfo(attention_mask.dtype).min
    for i in range(len(cumulative_seqlens_q) - 1):
        seqlen_q = cumulative_seqlens_q[i + 1] - cumulative_seqlens_q[i]
        seqlen_k = cumulative_seqlens_k[i + 1] - cumulative_seqlens_k[i]
        if seqlen_q < seqlen_k and seqlen_q >= 1:
            causal_diagonal = seqlen_k - seqlen_q + 1
        else:
            causal_diagonal = 1
        query_range = slice(cumulative_seqlens_q[i], cumulative_seqlens_q[i + 1])
        key_range = slice(cumulative_seqlens_k[i], cumulative_seqlens_k[i + 1])
        # Apply causal mask
        minus_inf = torch.full(
            attention_mask[..., query_range, key_range].shape,
            min_value,
            dtype=attention_mask.dtype,
            device=attention_mask.device,
        )
        masked = torch.triu(minus_inf, diagonal=causal_diagonal)
        # Apply sliding window mask if needed
        if sliding_window > 1:
            if FIXED:
                sliding_diagonal = seqlen_k - seqlen_q - sliding_window
                masked += torch.tril(minus_inf, diagonal=sliding_diagonal)
            else:
                sliding_diagonal = seqlen_k - seqlen_q + sliding_window
                masked = torch.tril(masked, diagonal=sliding_diagonal)
        attention_mask[..., query_range, key_range] = masked


class PagedAttentionCache:
    """Block-table KV cache: one list of physical blocks per request."""

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim):
        self.block_size = block_size
        self.key_cache = torch.zeros(num_blocks * block_size, num_kv_heads, head_dim)
        self.value_cache = torch.zeros(num_blocks * block_size, num_kv_heads, head_dim)
        self.block_table = {}
        self._free = list(range(num_blocks))

    def allocate(self, request_id, n_tokens):
        blocks = self.block_table.setdefault(request_id, [])
        while len(blocks) * self.block_size < n_tokens:
            blocks.append(self._free.pop(0))

    def slots(self, request_id, start, end):
        blocks = self.block_table[request_id]
        return torch.tensor([blocks[p // self.block_size] * self.block_size + p % self.block_size
                             for p in range(start, end)])

    def update(self, key_states, value_states, write_index):
        self.key_cache[write_index] = key_states
        self.value_cache[write_index] = value_states

    def read(self, read_index):
        return self.key_cache[read_index], self.value_cache[read_index]


class ContinuousBatchProcessor:
    def __init__(self, cache, config):
        self.cache = cache
        self.config = config
        # Retrieve the size of the sliding window if there is one
        self.sliding_window = 1 if getattr(config, "sliding_window", None) is None else config.sliding_window

    def prepare_batch_tensors(self, requests):
        cumulative_seqlens_q, cumulative_seqlens_k = [0], [0]
        write_index, read_index = [], []
        for req in requests:
            past, new = req["position_offset"], len(req["new_tokens"])
            self.cache.allocate(req["id"], past + new)
            write_index.append(self.cache.slots(req["id"], past, past + new))
            read_index.append(self.cache.slots(req["id"], 0, past + new))
            cumulative_seqlens_q.append(cumulative_seqlens_q[-1] + new)
            cumulative_seqlens_k.append(cumulative_seqlens_k[-1] + past + new)
        total_q, total_k = cumulative_seqlens_q[-1], cumulative_seqlens_k[-1]
        attention_mask = torch.full((1, 1, total_q, total_k), torch.finfo(torch.float32).min)
        build_attention_mask(attention_mask, cumulative_seqlens_q, cumulative_seqlens_k,
                             sliding_window=self.sliding_window)
        return {
            "attention_mask": attention_mask,
            "cumulative_seqlens_q": cumulative_seqlens_q,
            "cumulative_seqlens_k": cumulative_seqlens_k,
            "write_index": torch.cat(write_index),
            "read_index": torch.cat(read_index),
        }


def sdpa_attention_paged_forward(module, query, key, value, attention_mask, cache, write_index,
                                 read_index):
    """query/key/value: [1, heads, packed_tokens, head_dim]; keys are gathered from the paged cache."""
    cache.update(key[0].transpose(0, 1), value[0].transpose(0, 1), write_index)
    k, v = cache.read(read_index)
    k = k.transpose(0, 1).unsqueeze(0).repeat_interleave(module.num_key_value_groups, dim=1)
    v = v.transpose(0, 1).unsqueeze(0).repeat_interleave(module.num_key_value_groups, dim=1)
    return F.scaled_dot_product_attention(query, k, v, attn_mask=attention_mask, scale=module.scaling)


class MistralAttention(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads, self.num_kv = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv
        self.scaling = self.head_dim ** -0.5
        self.q_proj = torch.nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(config.hidden_size, self.num_kv * self.head_dim, bias=False)

    def forward(self, hidden_states, cache, attention_mask, write_index, read_index, **kwargs):
        t = hidden_states.shape[1]
        q = self.q_proj(hidden_states).view(1, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(1, t, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(1, t, self.num_kv, self.head_dim).transpose(1, 2)
        return sdpa_attention_paged_forward(self, q, k, v, attention_mask, cache, write_index, read_index)


def main():
    config = SimpleNamespace(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    cache = PagedAttentionCache(num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)
    attn = MistralAttention(config)
    processor = ContinuousBatchProcessor(cache, config)

    # previously processed tokens of requests "b" (8 tokens) and "c" (first 5-token chunk)
    for rid, n in (("b", 8), ("c", 5)):
        cache.allocate(rid, n)
        slots = cache.slots(rid, 0, n)
        cache.key_cache[slots] = torch.randn(n, 2, 8)
        cache.value_cache[slots] = torch.randn(n, 2, 8)

    requests = [
        {"id": "a", "position_offset": 0, "new_tokens": list(range(10))},
        {"id": "b", "position_offset": 8, "new_tokens": [7]},
        {"id": "c", "position_offset": 5, "new_tokens": [3, 1, 4, 1]},
    ]
    batch = processor.prepare_batch_tensors(requests)
    hidden = torch.randn(1, batch["cumulative_seqlens_q"][-1], config.hidden_size)
    with torch.no_grad():
        out = attn(hidden, cache, **batch)
    print("packed attention output:", tuple(out.shape), "sum", round(out.sum().item(), 4))


if __name__ == "__main__":
    main()
