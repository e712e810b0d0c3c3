# vllm-project/vllm#27035 ("[fix][cpu] fix prefill attention in CPU attention backend", fixes #27034).
# vLLM V1 CPU backend (vllm/v1/attention/backends/cpu_attn.py, TorchSDPABackendImpl): after #26096 the
# batch is reordered with decode requests in front of prefill requests, but _run_sdpa_forward still
# walked the prefill sequences from row 0 of the flattened query/key/value, so in a mixed
# prefill + decode step each prompt's SDPA call was handed the decode tokens' rows and the wrong
# slice of its own (batched prompts answered differently from the same prompts run one at a time).
# Fix: start_q / start_kv begin at attn_metadata.num_decode_tokens.
# Trimmed port: one engine step with one decode request and two prompts, paged KV cache, tiny model.
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.nn.functional import scaled_dot_product_attention

FIXED = "--fixed" in sys.argv


class AttentionType:
    DECODER = "decoder"


@dataclass
class CommonAttentionMetadata:
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor
    num_reqs: int
    max_query_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor


def split_decodes_and_prefills(common_attn_metadata, decode_threshold=1, require_uniform=False):
    max_query_len = common_attn_metadata.max_query_len
    num_reqs = common_attn_metadata.num_reqs
    query_start_loc = common_attn_metadata.query_start_loc_cpu
    num_tokens = int(query_start_loc[-1])
    if max_query_len <= decode_threshold:
        return num_reqs, 0, num_tokens, 0
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    is_prefill = query_lens > decode_threshold
    if not torch.any(is_prefill):
        return num_reqs, 0, num_tokens, 0
    first_prefill = int(is_prefill.int().argmax(dim=-1))
    num_decodes = first_prefill
    num_prefills = num_reqs - num_decodes
    num_decode_tokens = int(query_start_loc[first_prefill])
    num_prefill_tokens = num_tokens - num_decode_tokens
    return num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens


@dataclass
class TorchSDPAMetadata:
    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor
    seq_lens: Optional[list]
    decode_seq_lens_tensor: Optional[torch.Tensor]
    decode_max_seq_len: int
    decode_block_tables: Optional[torch.Tensor]
    chunked_prefill: bool
    max_query_len: int
    prefill_max_seq_len: int
    prefill_query_start_loc: Optional[torch.Tensor]
    prefill_seq_start_loc: Optional[torch.Tensor]
    prefill_block_tables: Optional[torch.Tensor]
    query_start_loc: Optional[torch.Tensor]
    attn_bias: Optional[list] = None

    @property
    def prefill_metadata(self):
        if self.num_prefill_tokens == 0:
            return None
        return self

    @property
    def decode_metadata(self):
        if self.num_decode_tokens == 0:
            return None
        return self

    def get_seq_lens(self, attn_type):
        seq_lens_q = self.seq_lens
        seq_lens_kv = self.seq_lens
        return seq_lens_q, seq_lens_kv

    def get_attn_bias(self, attn_type):
        return self.attn_bias

    def set_attn_bias(self, attn_bias, attn_type):
        self.attn_bias = attn_bias

    def get_seq_len_block_table_args(self, attn_type):
        return (self.decode_seq_lens_tensor, self.decode_max_seq_len, self.decode_block_tables)


class TorchSDPAMetadataBuilderV1:
    reorder_batch_threshold: int = 1

    def __init__(self, max_num_seqs, chunked_prefill_enabled=False):
        self.chunked_prefill_enabled = chunked_prefill_enabled
        self.seq_start_loc_cpu = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device="cpu")
        self.seq_start_loc_np = self.seq_start_loc_cpu.numpy()

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        num_reqs = common_attn_metadata.num_reqs
        max_query_len = common_attn_metadata.max_query_len

        seq_lens_cpu = common_attn_metadata.seq_lens_cpu
        seq_lens_np = seq_lens_cpu.numpy()

        query_start_loc_cpu = common_attn_metadata.query_start_loc_cpu.clone()
        query_start_loc_np = query_start_loc_cpu.numpy()

        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = (
            split_decodes_and_prefills(
                common_attn_metadata,
                decode_threshold=self.reorder_batch_threshold,
                require_uniform=True,
            )
        )

        max_prefill_seq_len = (
            seq_lens_np[num_decodes:num_reqs].max().item() if num_prefills > 0 else 0
        )
        max_decode_seq_len = (
            seq_lens_np[:num_decodes].max().item() if num_prefills < num_reqs else 0
        )
        self.seq_start_loc_np[0] = 0
        np.cumsum(seq_lens_np, out=self.seq_start_loc_np[1 : num_reqs + 1])

        slot_mapping = common_attn_metadata.slot_mapping.long()
        block_table_tensor = common_attn_metadata.block_table_tensor
        query_start_loc_np[num_decodes : num_reqs + 1] -= num_decode_tokens

        return TorchSDPAMetadata(
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_decode_tokens,
            slot_mapping=slot_mapping,
            seq_lens=seq_lens_cpu.tolist()[num_decodes:],  # prefill
            decode_seq_lens_tensor=seq_lens_cpu[:num_decodes],  # decode
            decode_max_seq_len=max_decode_seq_len,  # decode
            decode_block_tables=block_table_tensor[:num_decodes],  # decode
            chunked_prefill=self.chunked_prefill_enabled,
            max_query_len=max_query_len,
            prefill_max_seq_len=max_prefill_seq_len,
            prefill_query_start_loc=query_start_loc_cpu[num_decodes : num_reqs + 1],
            prefill_seq_start_loc=self.seq_start_loc_cpu[num_decodes : num_reqs + 1],
            prefill_block_tables=block_table_tensor[num_decodes:num_reqs],
            query_start_loc=query_start_loc_cpu[: num_reqs + 1],
        )


class _PagedAttention:
    """Plain-torch stand-in for vLLM's CPU paged-attention ops (write + decode)."""

    block_size = 4

    @staticmethod
    def split_kv_cache(kv_cache, num_kv_heads, head_size):
        key_cache = kv_cache[0].view(-1, num_kv_heads, head_size)
        value_cache = kv_cache[1].view(-1, num_kv_heads, head_size)
        return key_cache, value_cache

    @staticmethod
    def write_to_paged_cache(key, value, key_cache, value_cache, slot_mapping, *args):
        key_cache[slot_mapping] = key
        value_cache[slot_mapping] = value

    @classmethod
    def forward_decode(cls, output, query, key_cache, value_cache, block_tables, seq_lens,
                       max_seq_len, kv_cache_dtype, num_kv_heads, scale, alibi_slopes, k_scale, v_scale):
        num_heads = query.shape[1]
        for i in range(query.shape[0]):
            n = int(seq_lens[i])
            pos = torch.arange(n)
            slots = block_tables[i][pos // cls.block_size] * cls.block_size + pos % cls.block_size
            k = key_cache[slots].repeat_interleave(num_heads // num_kv_heads, dim=1)
            v = value_cache[slots].repeat_interleave(num_heads // num_kv_heads, dim=1)
            s = torch.einsum("hd,nhd->hn", query[i], k) * scale
            output[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)


class TorchSDPABackendImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads, kv_cache_dtype="auto"):
        self.paged_attn_impl = _PagedAttention
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = None
        self.sliding_window = None
        self.kv_cache_dtype = kv_cache_dtype
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.need_mask = self.alibi_slopes is not None or self.sliding_window is not None
        self.attn_type = AttentionType.DECODER

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        if attn_metadata is None:
            return query
        attn_type = self.attn_type
        query = query.view(-1, self.num_heads, self.head_size)
        key = key.view(-1, self.num_kv_heads, self.head_size)
        value = value.view(-1, self.num_kv_heads, self.head_size)

        key_cache, value_cache = self.paged_attn_impl.split_kv_cache(
            kv_cache, self.num_kv_heads, self.head_size
        )
        updated_slot_mapping = attn_metadata.slot_mapping
        self.paged_attn_impl.write_to_paged_cache(
            key, value, key_cache, value_cache, updated_slot_mapping,
            self.kv_cache_dtype, layer._k_scale, layer._v_scale,
        )

        num_prefill_tokens = attn_metadata.num_prefill_tokens
        num_decode_tokens = attn_metadata.num_decode_tokens
        assert key.shape[0] == num_prefill_tokens + num_decode_tokens
        assert value.shape[0] == num_prefill_tokens + num_decode_tokens

        output = torch.empty_like(query)
        if prefill_meta := attn_metadata.prefill_metadata:
            if not prefill_meta.prefill_metadata.chunked_prefill:
                assert attn_metadata.seq_lens is not None
                self._run_sdpa_forward(output, query, key, value, prefill_meta, attn_type=attn_type)
        if decode_meta := attn_metadata.decode_metadata:
            seq_lens_arg, max_seq_len_arg, block_tables_arg = (
                decode_meta.get_seq_len_block_table_args(attn_type)
            )
            self.paged_attn_impl.forward_decode(
                output[: attn_metadata.num_decode_tokens, :, :],
                query[: attn_metadata.num_decode_tokens, :, :],
                key_cache, value_cache, block_tables_arg, seq_lens_arg, max_seq_len_arg,
                self.kv_cache_dtype, self.num_kv_heads, self.scale, self.alibi_slopes,
                layer._k_scale, layer._v_scale,
            )
        return output.view(-1, self.num_heads * self.head_size)

    def _run_sdpa_forward(self, output, query, key, value, attn_metadata, attn_type=AttentionType.DECODER):
        attn_masks = attn_metadata.get_attn_bias(attn_type)
        if attn_masks is None:
            seq_lens, _ = attn_metadata.get_seq_lens(attn_type)
            attn_masks = [None] * len(seq_lens)
            attn_metadata.set_attn_bias(attn_masks, attn_type)

        query = query.movedim(0, query.dim() - 2)
        key = key.movedim(0, key.dim() - 2)
        value = value.movedim(0, value.dim() - 2)

        if self.num_kv_heads != self.num_heads:
            key = key.repeat_interleave(self.num_queries_per_kv, dim=-3)
            value = value.repeat_interleave(self.num_queries_per_kv, dim=-3)

        causal_attn = attn_type == AttentionType.DECODER

        seq_lens_q, seq_lens_kv = attn_metadata.get_seq_lens(attn_type)
        if FIXED:
            # Incoming Q and KV contain decoded tokens as well, hence start at an offset
            # equal to num_decode_tokens since decode requests appear first
            start_q, start_kv = (
                attn_metadata.num_decode_tokens,
                attn_metadata.num_decode_tokens,
            )
        else:
            start_q, start_kv = 0, 0
        for seq_len_q, seq_len_kv, mask in zip(seq_lens_q, seq_lens_kv, attn_masks):
            end_q = start_q + seq_len_q
            end_kv = start_kv + seq_len_kv
            sub_out = (
                scaled_dot_product_attention(
                    query[None, :, start_q:end_q, :],
                    key[None, :, start_kv:end_kv, :],
                    value[None, :, start_kv:end_kv, :],
                    attn_mask=mask,
                    dropout_p=0.0,
                    is_causal=causal_attn and mask is None,
                    scale=self.scale,
                )
                .squeeze(0)
                .movedim(query.dim() - 2, 0)
            )
            output[start_q:end_q, :, :] = sub_out
            start_q, start_kv = end_q, end_kv


class Attention(torch.nn.Module):
    def __init__(self, hidden, num_heads, num_kv_heads):
        super().__init__()
        self.head_dim = hidden // num_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.qkv_proj = torch.nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * self.head_dim)
        self.o_proj = torch.nn.Linear(num_heads * self.head_dim, hidden)
        self.impl = TorchSDPABackendImpl(num_heads, self.head_dim, self.head_dim ** -0.5, num_kv_heads)
        self._k_scale = self._v_scale = 1.0

    def rope(self, x, positions):
        half = self.head_dim // 2
        inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        ang = positions[:, None].float() * inv[None]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def forward(self, positions, hidden_states, kv_cache, attn_metadata):
        q, k, v = self.qkv_proj(hidden_states).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
             self.num_kv_heads * self.head_dim], -1)
        q = self.rope(q.view(-1, self.num_heads, self.head_dim), positions).flatten(1)
        k = self.rope(k.view(-1, self.num_kv_heads, self.head_dim), positions).flatten(1)
        return self.o_proj(self.impl.forward(self, q, k, v, kv_cache, attn_metadata))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=64, hidden=32, heads=4, kv_heads=2, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(Attention(hidden, heads, kv_heads) for _ in range(layers))
        self.lm_head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        h = self.embed(input_ids)
        for layer, kv in zip(self.layers, kv_caches):
            h = h + layer(positions, h, kv, attn_metadata)
        return self.lm_head(h)


def main():
    torch.manual_seed(0)
    model = TinyLM().eval()
    bs = _PagedAttention.block_size
    num_blocks, kv_heads, head_dim = 16, 2, 8
    kv_caches = [torch.zeros(2, num_blocks, bs * kv_heads * head_dim) for _ in model.layers]
    builder = TorchSDPAMetadataBuilderV1(max_num_seqs=8)

    # request -> (token ids so far, block table)
    reqs = {
        "r0": ([5, 17, 33, 2, 9], [0, 1]),
        "r1": ([11, 40, 7, 7, 23, 61, 3], [2, 3]),
        "r2": ([30, 8, 52, 19, 44, 1], [4, 5]),
    }

    def step(sched):
        # sched: list of (req, num_computed, num_new); decodes first, as the reorder leaves them
        ids, pos, slots, qlens, slens, btabs = [], [], [], [], [], []
        for r, done, new in sched:
            toks, bt = reqs[r]
            for p in range(done, done + new):
                ids.append(toks[p]); pos.append(p)
                slots.append(bt[p // bs] * bs + p % bs)
            qlens.append(new); slens.append(done + new)
            btabs.append(bt + [0] * (4 - len(bt)))
        qsl = torch.tensor([0] + list(np.cumsum(qlens)), dtype=torch.int32)
        cam = CommonAttentionMetadata(
            query_start_loc_cpu=qsl, seq_lens_cpu=torch.tensor(slens, dtype=torch.int32),
            num_computed_tokens_cpu=torch.tensor([s[1] for s in sched]), num_reqs=len(sched),
            max_query_len=max(qlens), block_table_tensor=torch.tensor(btabs),
            slot_mapping=torch.tensor(slots))
        md = builder.build(0, cam)
        with torch.no_grad():
            logits = model(torch.tensor(ids), torch.tensor(pos), kv_caches, md)
        logits_indices = qsl[1:].long() - 1
        return logits[logits_indices]

    # step 1: r0's prompt alone
    out = step([("r0", 0, 5)])
    reqs["r0"][0].append(int(out[0].argmax()))
    # step 2: r0 decodes while r1 and r2 are prefilled in the same batch
    out = step([("r0", 5, 1), ("r1", 0, 7), ("r2", 0, 6)])
    for name, row in zip(["r0", "r1", "r2"], out):
        print(name, "next token", int(row.argmax()), "logit[0:4]", [round(x, 4) for x in row[:4].tolist()])


if __name__ == "__main__":
    main()
