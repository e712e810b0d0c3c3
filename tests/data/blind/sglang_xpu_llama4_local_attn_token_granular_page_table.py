# sgl-project/sglang#23757 ("[Intel GPU] Fix incorrect KV-cache page table for local attention when page_size > 1",
# merged). Ported from python/sglang/srt/layers/attention/xpu_backend.py (XPUAttentionBackend.init_forward_metadata's
# extend branch, _init_local_attn_metadata, forward_extend), make_local_attention_virtual_batches from
# flashattention_backend.py, and the Llama 4 attention of models/llama4.py (RoPE + chunked local attention on
# three layers of four, `use_irope=self.use_rope`; NoPE + temperature tuning + global attention on the fourth).
# The pools are trimmed (ReqToTokenPool.req_to_token holds one KV slot per token, MHATokenToKVPool one buffer per
# layer, pages handed out by a paged allocator) and sgl_kernel's flash_attn_with_kvcache is a torch stand-in that
# reads k_cache viewed as (num_pages, page_size, H, D) through a page table of page indices.
# Bug: with page_size > 1, _init_local_attn_metadata handed make_local_attention_virtual_batches the raw
# token-granular req_to_token rows (column i = the KV slot of token i), while it indexes the table by
# `k_seqstarts_absolute // page_size` and the kernel reads each entry as a physical page index: the chunked layers
# of Llama 4 read pages that are not the request's.
# Fix: stride the table by page_size and divide by page_size (page-granular, as init_forward_metadata does for
# metadata.page_table) before building the local virtual batches.
import sys
from dataclasses import dataclass
from enum import IntEnum, auto
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
from transformers import Llama4TextConfig

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- sgl_kernel stand-in
def flash_attn_with_kvcache(q, k_cache, v_cache, page_table, cache_seqlens, cu_seqlens_q, cu_seqlens_k_new=None,
                            max_seqlen_q=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            k_descale=None, v_descale=None, return_softmax_lse=False, out=None):
    # varlen q; paged KV: row b reads pages page_table[b, :cdiv(n_k, page_size)] of k_cache
    # (num_pages, page_size, H_kv, D) and attends to their first cache_seqlens[b] keys; causal aligned bottom-right.
    page_size = k_cache.shape[1]
    n_rep = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(cache_seqlens.shape[0]):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if qe == qs:
            continue
        n_k = int(cache_seqlens[b])
        pages = page_table[b, : cdiv(n_k, page_size)].long()
        k = k_cache[pages].reshape(-1, k_cache.shape[2], k_cache.shape[3])[:n_k].repeat_interleave(n_rep, dim=1)
        v = v_cache[pages].reshape(-1, v_cache.shape[2], v_cache.shape[3])[:n_k].repeat_interleave(n_rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe], k) * softmax_scale
        if causal:
            n_q = qe - qs
            allowed = torch.arange(n_k)[None, :] <= (torch.arange(n_q)[:, None] + n_k - n_q)
            scores = scores.masked_fill(~allowed, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def cdiv(a, b):
    """Ceiling division."""
    return -(a // -b)


# ---------------------------------------------------------------- flashattention_backend.py
def make_local_attention_virtual_batches(
    attn_chunk_size: int,
    query_start_loc_np: np.ndarray,
    seq_lens_np: np.ndarray,
    block_table: torch.Tensor,
    page_size: int = 0,
):
    # Adjust attention_chunk_size based on the actual sequence length
    # to avoid index out of bounds errors
    max_seq_len = seq_lens_np.max()
    effective_chunk_size = min(attn_chunk_size, max_seq_len)
    # Make sure effective_chunk_size is divisible by page_size
    effective_chunk_size = (effective_chunk_size // page_size) * page_size
    if effective_chunk_size < page_size:
        effective_chunk_size = page_size
    attn_chunk_size = effective_chunk_size

    q_seqlens = query_start_loc_np[1:] - query_start_loc_np[:-1]
    actual_batch_size = seq_lens_np.shape[0]

    q_tokens_in_first_block = np.minimum(
        attn_chunk_size - ((seq_lens_np - q_seqlens) % attn_chunk_size), q_seqlens
    ).astype(np.int32)
    tokens_in_last_block = attn_chunk_size + (seq_lens_np % -attn_chunk_size)
    local_blocks = 1 + cdiv(q_seqlens - q_tokens_in_first_block, attn_chunk_size)

    cu_num_blocks = np.cumsum(local_blocks)
    virtual_batches = cu_num_blocks[-1]
    block_offsets = np.repeat(cu_num_blocks - local_blocks, local_blocks)
    arange = np.arange(virtual_batches, dtype=np.int32) - block_offsets
    rarange = np.repeat(local_blocks, local_blocks) - arange - 1
    seqlens_q_local = np.repeat(q_seqlens - q_tokens_in_first_block, local_blocks)
    seqlens_q_local[arange == 0] = q_tokens_in_first_block
    seqlens_q_local[arange > 0] = np.minimum(
        seqlens_q_local - attn_chunk_size * (arange - 1), attn_chunk_size
    )[arange > 0]

    cu_seqlens_q_local = np.pad(np.cumsum(seqlens_q_local), (1, 0)).astype(np.int32)

    seqlens_k_local = np.full(cu_num_blocks[-1], attn_chunk_size, dtype=np.int32)
    seqlens_k_local[cu_num_blocks - 1] = tokens_in_last_block

    k_seqstarts_absolute = np.repeat(seq_lens_np, local_blocks) - (
        rarange * attn_chunk_size + np.repeat(tokens_in_last_block, local_blocks)
    )
    block_starts = k_seqstarts_absolute // page_size

    assert attn_chunk_size % page_size == 0, (
        f"attn_chunk_size {attn_chunk_size} is not "
        f"divisible by page_size {page_size}"
    )
    pages_per_local_batch = attn_chunk_size // page_size

    block_indices = np.broadcast_to(
        np.arange(pages_per_local_batch, dtype=np.int32),
        (virtual_batches, pages_per_local_batch),
    ) + np.expand_dims(block_starts, axis=1)
    block_indices = block_indices.flatten().clip(max=block_table.shape[1] - 1)
    batch_indices = np.repeat(
        np.arange(actual_batch_size, dtype=np.int32),
        local_blocks * pages_per_local_batch,
    )
    batch_indices_torch = torch.from_numpy(batch_indices)
    block_indices_torch = torch.from_numpy(block_indices)
    block_table_local = block_table[batch_indices_torch, block_indices_torch].view(
        virtual_batches, -1
    )

    return seqlens_q_local, cu_seqlens_q_local, seqlens_k_local, block_table_local


@dataclass
class FlashAttentionMetadata:
    cache_seqlens_int32: torch.Tensor = None
    max_seq_len_q: int = 1
    max_seq_len_k: int = 0
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_k: torch.Tensor = None
    page_table: torch.Tensor = None

    @dataclass
    class LocalAttentionMetadata:
        local_query_start_loc: torch.Tensor = None
        local_seqused_k: torch.Tensor = None
        local_block_table: torch.Tensor = None
        local_max_query_len: int = 0
        local_max_seq_len: int = 0

    local_attn_metadata: Optional[LocalAttentionMetadata] = None


# ---------------------------------------------------------------- pools, forward batch
class ForwardMode(IntEnum):
    EXTEND = auto()
    DECODE = auto()


class ReqToTokenPool:
    def __init__(self, size, max_context_len):
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32)


class MHATokenToKVPool:
    def __init__(self, size, page_size, head_num, head_dim, layer_num):
        # slot 0 .. page_size - 1 is the padding page, as sglang allocates size + page_size slots
        self.k_buffer = [torch.zeros((size + page_size, head_num, head_dim)) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros((size + page_size, head_num, head_dim)) for _ in range(layer_num)]

    def get_kv_buffer(self, layer_id):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer[layer.layer_id][loc] = cache_k
        self.v_buffer[layer.layer_id][loc] = cache_v


class PagedTokenToKVPoolAllocator:
    def __init__(self, size, page_size, page_order):
        self.page_size = page_size
        self.free_pages = list(page_order)

    def alloc_extend(self, num_tokens):
        pages = [self.free_pages.pop(0) for _ in range(cdiv(num_tokens, self.page_size))]
        slots = torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages])
        return slots[:num_tokens]


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_seq_lens_cpu: list
    extend_prefix_lens_cpu: list
    req_to_token_pool: ReqToTokenPool = None
    token_to_kv_pool: MHATokenToKVPool = None
    attn_backend: "XPUAttentionBackend" = None


# ---------------------------------------------------------------- xpu_backend.py
class XPUAttentionBackend:
    def __init__(self, req_to_token_pool, token_to_kv_pool, page_size, attention_chunk_size):
        self.forward_metadata: FlashAttentionMetadata = None
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.req_to_token = req_to_token_pool.req_to_token
        self.page_size = page_size
        self.is_hybrid_swa = False
        self.attention_chunk_size = attention_chunk_size
        self.device = "cpu"

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        metadata = FlashAttentionMetadata()
        seqlens_in_batch = forward_batch.seq_lens
        device = seqlens_in_batch.device

        # extend
        metadata.cache_seqlens_int32 = seqlens_in_batch.to(torch.int32)
        metadata.max_seq_len_k = forward_batch.seq_lens_cpu.max().item()
        metadata.cu_seqlens_k = torch.nn.functional.pad(
            torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0)
        )
        metadata.page_table = self.req_to_token_pool.req_to_token[
            forward_batch.req_pool_indices, : metadata.max_seq_len_k
        ]

        if any(forward_batch.extend_prefix_lens_cpu):
            extend_seq_lens = forward_batch.extend_seq_lens
            metadata.max_seq_len_q = max(forward_batch.extend_seq_lens_cpu)
            metadata.cu_seqlens_q = torch.nn.functional.pad(
                torch.cumsum(extend_seq_lens, dim=0, dtype=torch.int32), (1, 0)
            )
        else:
            metadata.max_seq_len_q = metadata.max_seq_len_k
            metadata.cu_seqlens_q = metadata.cu_seqlens_k

        # Setup local attention if enabled
        if forward_batch.forward_mode == ForwardMode.EXTEND:
            self._init_local_attn_metadata(forward_batch, metadata, device)

        # Convert the page table to a strided format which is needed by FA3 API
        if self.page_size > 1:
            self.strided_indices = torch.arange(
                0, metadata.page_table.shape[1], self.page_size, device=self.device
            )
            metadata.page_table = (
                metadata.page_table[:, self.strided_indices] // self.page_size
            )

        self.forward_metadata = metadata

    def _init_local_attn_metadata(self, forwardbatch, metadata, device):
        """Centralized utility to initialize local_attn_metadata if chunked attention is enabled."""
        if self.attention_chunk_size is None:
            metadata.local_attn_metadata = None
            return

        cu_seqlens_q = metadata.cu_seqlens_q
        cache_seqlens_int32 = metadata.cache_seqlens_int32
        page_table = metadata.page_table
        if cu_seqlens_q is None or cache_seqlens_int32 is None or page_table is None:
            metadata.local_attn_metadata = None
            return

        if FIXED:
            if self.page_size > 1:
                strided_indices = torch.arange(
                    0, page_table.shape[1], self.page_size, device=page_table.device
                )
                page_table = page_table[:, strided_indices] // self.page_size

        cu_seqlens_q_np = cu_seqlens_q.cpu().numpy()
        seq_lens_np = cache_seqlens_int32.cpu().numpy()
        (
            seqlens_q_local_np,
            cu_seqlens_q_local_np,
            seqlens_k_local_np,
            block_table_local,
        ) = make_local_attention_virtual_batches(
            self.attention_chunk_size,
            cu_seqlens_q_np,
            seq_lens_np,
            page_table,
            self.page_size,
        )

        local_metadata = FlashAttentionMetadata.LocalAttentionMetadata(
            local_query_start_loc=torch.from_numpy(cu_seqlens_q_local_np).to(device),
            local_seqused_k=torch.from_numpy(seqlens_k_local_np).to(device),
            local_block_table=block_table_local.to(device),
            local_max_query_len=int(seqlens_q_local_np.max()),
            local_max_seq_len=int(seqlens_k_local_np.max()),
        )
        metadata.local_attn_metadata = local_metadata

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)

        metadata = self.forward_metadata
        window_size = (-1, -1)
        causal = True

        use_local_attn = (
            self.attention_chunk_size is not None
            and metadata.local_attn_metadata is not None
            and (hasattr(layer, "use_irope") and layer.use_irope)
        )

        if use_local_attn:
            local_metadata = metadata.local_attn_metadata
            page_table = local_metadata.local_block_table
            cu_seqlens_q = local_metadata.local_query_start_loc
            cache_seqlens = local_metadata.local_seqused_k
            max_seqlen_q = local_metadata.local_max_query_len
        else:
            page_table = metadata.page_table
            cu_seqlens_q = metadata.cu_seqlens_q
            cache_seqlens = metadata.cache_seqlens_int32
            max_seqlen_q = metadata.max_seq_len_q

        key_cache, value_cache = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        key_cache = key_cache.view(-1, self.page_size, layer.tp_k_head_num, layer.head_dim)
        value_cache = value_cache.view(-1, self.page_size, layer.tp_v_head_num, layer.head_dim)
        o = flash_attn_with_kvcache(
            q=q.contiguous().view(-1, layer.tp_q_head_num, layer.head_dim),
            k_cache=key_cache,
            v_cache=value_cache,
            page_table=page_table,
            cache_seqlens=cache_seqlens,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k_new=None,
            max_seqlen_q=max_seqlen_q,
            softmax_scale=layer.scaling,
            causal=causal,
            window_size=window_size,
            softcap=layer.logit_cap,
        )
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)


# ---------------------------------------------------------------- layers/radix_attention.py, models/llama4.py
class RadixAttention(nn.Module):
    def __init__(self, num_heads, head_dim, scaling, num_kv_heads, layer_id, use_irope=False):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.logit_cap = 0.0
        self.use_irope = use_irope

    def forward(self, q, k, v, forward_batch):
        k = k.view(-1, self.tp_k_head_num, self.head_dim)
        v = v.view(-1, self.tp_v_head_num, self.v_head_dim)
        return forward_batch.attn_backend.forward_extend(q, k, v, self, forward_batch)


def get_rope(head_size, base):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float) / head_size))

    def rotary_emb(positions, q, k):
        freqs = positions.float()[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()

        def rot(x):
            x = x.view(x.shape[0], -1, head_size)
            x1, x2 = x[..., : head_size // 2], x[..., head_size // 2:]
            c, s = cos[:, None, :], sin[:, None, :]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(1)

        return rot(q), rot(k)

    return rotary_emb


class Llama4Attention(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.layer_id = layer_id
        self.hidden_size = config.hidden_size
        self.use_rope = int((layer_id + 1) % 4 != 0)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        self.attn_temperature_tuning = config.attn_temperature_tuning
        self.floor_scale = config.floor_scale
        self.attn_scale = config.attn_scale
        self.qkv_proj = nn.Linear(self.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, self.hidden_size, bias=False)
        self.rotary_emb = get_rope(self.head_dim, config.rope_parameters["rope_theta"]) if self.use_rope else None
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.scaling, num_kv_heads=self.num_kv_heads,
                                   layer_id=layer_id, use_irope=self.use_rope)

    def _get_attn_scale(self, positions):
        floor = torch.floor((positions + 1.0) / self.floor_scale)
        attn_scale = torch.log(floor + 1.0) * self.attn_scale + 1.0
        return attn_scale.unsqueeze(-1)

    def forward(self, positions, hidden_states, forward_batch):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        # We are applying temperature tuning (https://arxiv.org/abs/2501.19399) to NoPE layers, where
        # the inference-time temperature tuning function is customized to not affect short context
        # while working at very long context
        if self.attn_temperature_tuning and not self.use_rope:
            q = q * self._get_attn_scale(positions)
        attn_output = self.attn(q, k, v, forward_batch)
        return self.o_proj(attn_output)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Llama4DecoderLayer(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.self_attn = Llama4Attention(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = nn.Sequential(
            nn.Linear(config.hidden_size, config.intermediate_size_mlp, bias=False), nn.SiLU(),
            nn.Linear(config.intermediate_size_mlp, config.hidden_size, bias=False))

    def forward(self, positions, hidden_states, forward_batch):
        hidden_states = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states), forward_batch)
        return hidden_states + self.feed_forward(self.post_attention_layernorm(hidden_states))


class Llama4ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Llama4DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, forward_batch):
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, forward_batch)
        # LogitsProcessor: the last token of each request
        last_index = torch.cumsum(forward_batch.extend_seq_lens, dim=0) - 1
        return self.lm_head(self.norm(hidden_states[last_index]))


# ---------------------------------------------------------------- scheduler / model runner
def main():
    torch.manual_seed(0)
    config = Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_chunk_size=8,
        max_position_embeddings=64,
    )
    page_size = 4
    model = Llama4ForCausalLM(config).eval()

    req_to_token_pool = ReqToTokenPool(size=4, max_context_len=64)
    token_to_kv_pool = MHATokenToKVPool(size=256, page_size=page_size, head_num=config.num_key_value_heads,
                                        head_dim=config.head_dim, layer_num=config.num_hidden_layers)
    allocator = PagedTokenToKVPoolAllocator(256, page_size, page_order=[5, 2, 9, 3, 7, 11, 4, 8, 6, 10])
    attn_backend = XPUAttentionBackend(req_to_token_pool, token_to_kv_pool, page_size,
                                       attention_chunk_size=config.attention_chunk_size)

    prompts = [
        [3, 17, 42, 8, 25, 11, 60, 33, 19, 5, 48, 27, 14],
        [22, 9, 51, 36, 2, 44, 30, 13, 57, 6],
    ]
    req_pool_indices = torch.tensor([0, 1])
    out_cache_loc, positions, input_ids = [], [], []
    for i, ids in enumerate(prompts):
        loc = allocator.alloc_extend(len(ids))
        req_to_token_pool.req_to_token[req_pool_indices[i], : len(ids)] = loc.to(torch.int32)
        out_cache_loc.append(loc)
        positions.append(torch.arange(len(ids)))
        input_ids.append(torch.tensor(ids))
    seq_lens = torch.tensor([len(p) for p in prompts])
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=len(prompts), input_ids=torch.cat(input_ids),
        req_pool_indices=req_pool_indices, seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
        out_cache_loc=torch.cat(out_cache_loc), positions=torch.cat(positions), extend_seq_lens=seq_lens.clone(),
        extend_seq_lens_cpu=seq_lens.tolist(), extend_prefix_lens_cpu=[0] * len(prompts),
        req_to_token_pool=req_to_token_pool, token_to_kv_pool=token_to_kv_pool, attn_backend=attn_backend,
    )

    with torch.no_grad():
        attn_backend.init_forward_metadata(forward_batch)
        logits = model(forward_batch.input_ids, forward_batch.positions, forward_batch)
    next_token_ids = logits.argmax(-1)
    for i in range(len(prompts)):
        print(f"req {i}: next token {next_token_ids[i].item()}, logits[:4] {logits[i, :4].tolist()}")


if __name__ == "__main__":
    main()
