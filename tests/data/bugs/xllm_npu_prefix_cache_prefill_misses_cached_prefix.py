"""xLLM NPU paged attention: prefix-cache-hit prefill never attends the cached prefix.

Citation: xLLM-AI/xllm#2161 (commit 8f5d6adfc, "fix prefix-cache prefill
attention in Python graph path"), read in the upstream git history
(xllm/python/attention/npu_paged_attention.py).

Bug: `NpuPagedAttentionBackend._prefill` ran `npu_fused_infer_attention_score`
on the packed K/V of the tokens in the current forward only, with
`actual_seq_lengths_kv = actual_seq_lengths` (the query lengths) and no
`block_table`. On a prefix-cache hit the cached prefix K/V already lives in the
paged cache and only the new tokens are fed in, so those queries attended to
their own tokens and never to the cached prefix (output diverged from a full
recompute).

Fix: when `metadata.block_table` is set, attend over the paged cache through
`block_table` with `actual_seq_lengths_kv = self._actual_seq_kv` (full prefix +
new length per sequence) and `sparse_mode=3` (rightDownCausal, causal aligned
to the KV tail).

This program: the backend's `prepare` / `execute` / `_prefill` in plain torch.
`torch.ops.npu.npu_fused_infer_attention_score` is replaced by a torch port of
the documented TND semantics (cumulative actual_seq_lengths for queries;
packed or block-table K/V with actual_seq_lengths_kv; sparse_mode 3 =
causal aligned bottom-right), calling `F.scaled_dot_product_attention`.
Step 1 prefills request A (8 tokens). Step 2 is a batch: request A' shares A's
8-token prefix (two cached blocks, prefix-cache hit) and brings 3 new tokens;
request B is new with 5 tokens.
"""
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

_SPARSE_MODE_NONE = 0
_SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3


def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None,
                                    actual_seq_lengths=None, actual_seq_lengths_kv=None,
                                    block_table=None, num_heads=None, scale=None,
                                    input_layout="TND", num_key_value_heads=None,
                                    block_size=None, sparse_mode=0, softmax_lse_flag=False):
    """Torch port of torch_npu's FIA (TND layout) for the arguments used here."""
    out = torch.empty_like(query)
    head_dim = query.shape[-1]
    q_start = 0
    kv_start = 0
    for i, q_end in enumerate(actual_seq_lengths):
        q = query[q_start:q_end]
        if block_table is None:
            kv_end = actual_seq_lengths_kv[i]  # cumulative, packed K/V
            k = key[kv_start:kv_end]
            v = value[kv_start:kv_end]
            kv_start = kv_end
        else:
            kv_len = actual_seq_lengths_kv[i]  # per sequence, paged K/V
            nblk = (kv_len + block_size - 1) // block_size
            blocks = block_table[i, :nblk].long()
            k = key[blocks].reshape(-1, num_key_value_heads, head_dim)[:kv_len]
            v = value[blocks].reshape(-1, num_key_value_heads, head_dim)[:kv_len]
        q_len, kv_len = q.shape[0], k.shape[0]
        mask = None
        if sparse_mode == _SPARSE_MODE_RIGHT_DOWN_CAUSAL:
            mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        groups = num_heads // num_key_value_heads
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1).repeat_interleave(groups, 0),
            v.transpose(0, 1).repeat_interleave(groups, 0),
            attn_mask=mask,
            scale=scale,
        )
        out[q_start:q_end] = o.transpose(0, 1)
        q_start = q_end
    return out, None


def reshape_paged_cache(slot_mapping, key, value, key_cache, value_cache):
    key_cache.view(-1, *key_cache.shape[2:])[slot_mapping] = key
    value_cache.view(-1, *value_cache.shape[2:])[slot_mapping] = value


@dataclass
class AttentionMetadata:
    is_prefill: bool
    is_chunked_prefill: bool
    q_cu_seq_lens: Optional[torch.Tensor]
    kv_seq_lens: Optional[torch.Tensor]
    kv_seq_lens_host: Optional[torch.Tensor]
    block_table: Optional[torch.Tensor]
    slot_mapping: torch.Tensor


@dataclass
class LayerCache:
    key: torch.Tensor
    value: torch.Tensor


class NpuPagedAttentionBackend:
    def __init__(self, num_heads, num_kv_heads, head_dim, scale, sliding_window):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self._kv_caches = []
        self._metadata = None
        self._causal_mask = torch.triu(torch.ones(2048, 2048, dtype=torch.float32), 1).to(torch.int8)

    def bind_kv_caches(self, kv_caches):
        self._kv_caches = kv_caches

    def prepare(self, metadata: AttentionMetadata):
        self._metadata = metadata
        self._actual_seq_lens = metadata.q_cu_seq_lens[1:].tolist() if metadata.q_cu_seq_lens is not None else None
        if metadata.block_table is not None:
            self._block_table_i32 = metadata.block_table.to(torch.int32)
            real_batch = metadata.block_table.shape[0]
            kv_host = metadata.kv_seq_lens_host
            if kv_host.numel() == real_batch + 1:
                per_seq_kv = kv_host[1:] - kv_host[:-1]
            else:
                per_seq_kv = kv_host
            self._actual_seq_q = list(range(1, real_batch + 1))
            self._actual_seq_kv = per_seq_kv[:real_batch].tolist()
        else:
            self._block_table_i32 = None

    def execute(self, q, k, v, layer_id):
        metadata = self._metadata
        k_cache, v_cache = self._kv_caches[layer_id].key, self._kv_caches[layer_id].value
        num_tokens = q.shape[0]
        k_3d = k.view(num_tokens, self.num_kv_heads, self.head_dim).contiguous()
        v_3d = v.view(num_tokens, self.num_kv_heads, self.head_dim).contiguous()
        reshape_paged_cache(metadata.slot_mapping, k_3d, v_3d, k_cache, v_cache)
        q_3d = q.view(num_tokens, self.num_heads, self.head_dim).contiguous()
        if metadata.is_prefill or metadata.is_chunked_prefill:
            if FIXED:
                return self._prefill(q_3d, k_3d, v_3d, k_cache, v_cache, metadata, num_tokens)
            return self._prefill(q_3d, k_3d, v_3d, None, None, metadata, num_tokens)
        raise NotImplementedError("decode is not exercised here")

    def _prefill(self, q_3d, k_3d, v_3d, k_cache, v_cache, metadata, num_tokens):
        actual_seq = self._cumulative_seq_lens(metadata, num_tokens)

        if FIXED and metadata.block_table is not None:
            block_size = k_cache.size(1)
            k_flat = k_cache.view(k_cache.size(0), block_size, -1)
            v_flat = v_cache.view(v_cache.size(0), block_size, -1)
            output, _ = npu_fused_infer_attention_score(
                q_3d, k_flat, v_flat,
                pse_shift=None,
                atten_mask=self._causal_mask,
                block_table=self._block_table_i32,
                actual_seq_lengths=actual_seq,
                actual_seq_lengths_kv=self._actual_seq_kv,
                num_heads=self.num_heads,
                scale=self.scale,
                input_layout="TND",
                num_key_value_heads=self.num_kv_heads,
                block_size=block_size,
                sparse_mode=_SPARSE_MODE_RIGHT_DOWN_CAUSAL,
                softmax_lse_flag=False,
            )
            return output.reshape(num_tokens, self.num_heads * self.head_dim)

        output, _ = npu_fused_infer_attention_score(
            q_3d, k_3d, v_3d,
            pse_shift=None,
            atten_mask=self._causal_mask,
            actual_seq_lengths=actual_seq,
            actual_seq_lengths_kv=actual_seq,
            num_heads=self.num_heads,
            scale=self.scale,
            input_layout="TND",
            num_key_value_heads=self.num_kv_heads,
            sparse_mode=_SPARSE_MODE_RIGHT_DOWN_CAUSAL,
            softmax_lse_flag=False,
        )
        return output.reshape(num_tokens, self.num_heads * self.head_dim)

    def _cumulative_seq_lens(self, metadata, num_tokens):
        if self._actual_seq_lens is not None:
            return self._actual_seq_lens
        return [num_tokens]


class Attention(torch.nn.Module):
    def __init__(self, hidden, num_heads, num_kv_heads, backend, layer_id=0):
        super().__init__()
        self.head_dim = hidden // num_heads
        self.qkv = torch.nn.Linear(hidden, self.head_dim * (num_heads + 2 * num_kv_heads), bias=False)
        self.split = [num_heads * self.head_dim, num_kv_heads * self.head_dim, num_kv_heads * self.head_dim]
        self.backend = backend
        self.layer_id = layer_id

    def forward(self, x):
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        return self.backend.execute(q, k, v, self.layer_id)


def slots(block_row, start, end, block_size):
    return [block_row[p // block_size] * block_size + p % block_size for p in range(start, end)]


def main():
    torch.manual_seed(0)
    hidden, num_heads, num_kv_heads, block_size = 32, 4, 2, 4
    backend = NpuPagedAttentionBackend(num_heads, num_kv_heads, hidden // num_heads,
                                       (hidden // num_heads) ** -0.5, sliding_window=-1)
    num_blocks = 12
    backend.bind_kv_caches([LayerCache(
        torch.zeros(num_blocks, block_size, num_kv_heads, hidden // num_heads),
        torch.zeros(num_blocks, block_size, num_kv_heads, hidden // num_heads),
    )])
    attn = Attention(hidden, num_heads, num_kv_heads, backend)
    embed = torch.nn.Embedding(100, hidden)
    prefix = torch.randint(0, 100, (8,))

    with torch.no_grad():
        # Step 1: request A prefills its 8-token prompt into blocks [6, 2].
        block_table = torch.tensor([[6, 2, 0, 0]])
        backend.prepare(AttentionMetadata(
            is_prefill=True, is_chunked_prefill=False,
            q_cu_seq_lens=torch.tensor([0, 8]), kv_seq_lens=torch.tensor([8]),
            kv_seq_lens_host=torch.tensor([8]), block_table=block_table,
            slot_mapping=torch.tensor(slots([6, 2], 0, 8, block_size)),
        ))
        attn(embed(prefix))

        # Step 2: A' hits the prefix cache (blocks 6, 2 shared) and adds 3 tokens;
        # B is a fresh 5-token prompt.
        new_a = torch.randint(0, 100, (3,))
        new_b = torch.randint(0, 100, (5,))
        block_table = torch.tensor([[6, 2, 9, 0], [4, 7, 0, 0]])
        backend.prepare(AttentionMetadata(
            is_prefill=True, is_chunked_prefill=False,
            q_cu_seq_lens=torch.tensor([0, 3, 8]), kv_seq_lens=torch.tensor([11, 5]),
            kv_seq_lens_host=torch.tensor([11, 5]), block_table=block_table,
            slot_mapping=torch.tensor(slots([6, 2, 9], 8, 11, block_size) + slots([4, 7], 0, 5, block_size)),
        ))
        out = attn(embed(torch.cat([new_a, new_b])))
    print("fixed" if FIXED else "buggy", "prefill output checksum:", round(out.sum().item(), 4))


if __name__ == "__main__":
    main()
