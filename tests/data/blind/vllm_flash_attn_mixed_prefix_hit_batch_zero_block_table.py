"""vLLM (V0) flash-attn backend: a prompt with no prefix-cache hit, batched beside one with a hit,
gets an all-zero block table and attends block 0.

Citation: vllm-project/vllm#7018 ("[Bugfix] Fix block table for seqs that have prefix cache hits",
merged 2024-08; the symptom reports are vllm-project/vllm#7003, #6833, #5543).

Bug: `FlashAttentionMetadataBuilder._add_seq_group` filled a prompt's block table only when *that*
sequence group had a prefix-cache hit (`inter_data.prefix_cache_hit`). `build` pads the block tables
with `make_tensor_with_pad(pad=0)`, so as soon as one prompt in the batch hit the cache the tensor was
non-empty, `FlashAttentionImpl.forward` took the "prefix-enabled attention" path for every prefill
(keys read from the paged cache through `block_table`), and the prompt without a hit read its keys
and values from block 0, 0, 0, ... (another request's cached prefix) instead of its own blocks.

Fix: `build` computes `prefix_cache_hit = any(d.prefix_cache_hit for d in inter_data_list)` once for
the batch and passes it to `_add_seq_group`, which then gives every sequence its full block table.

Reproduction: the upstream metadata builder / model-runner prefix-hit trimming / backend forward, on
CPU. `flash_attn_varlen_func` and `reshape_and_cache_flash` are replaced by torch references of what
the kernels compute (paged gather through `block_table`, causal aligned bottom-right). A tiny
two-layer Llama (vLLM layout: qkv_proj, neox rotary, Attention(kv_cache, attn_metadata)). Step 1
prefills request 0 (an 8-token system prompt + 3 tokens). Step 2 prefills, in one batch, request 1
(same system prompt + 4 tokens: 2 blocks hit) and request 2 (an unrelated 6-token prompt, no hit).
"""
import sys
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

BLOCK_SIZE = 4
NUM_GPU_BLOCKS = 16
PAD_SLOT_ID = -1


# ----------------------------------------------------------------------------------------------
# vllm/utils.py, vllm/attention/backends/utils.py
# ----------------------------------------------------------------------------------------------
def make_tensor_with_pad(x: List[List[int]], pad: int, dtype, device=None) -> torch.Tensor:
    max_len = max((len(row) for row in x), default=0)
    padded = [row + [pad] * (max_len - len(row)) for row in x]
    return torch.tensor(padded, dtype=dtype, device=device)


def is_block_tables_empty(block_tables):
    if block_tables is None:
        return True
    if isinstance(block_tables, dict) and all(value is None for value in block_tables.values()):
        return True
    return False


def compute_slot_mapping_start_idx(is_prompt, query_len, context_len, sliding_window):
    start_idx = 0
    if is_prompt and sliding_window is not None:
        start_idx = max(0, query_len - sliding_window)
    return start_idx


def compute_slot_mapping(is_profile_run, slot_mapping, seq_id, seq_len, context_len, start_idx,
                         block_size, block_tables):
    if is_profile_run:
        slot_mapping.extend([PAD_SLOT_ID] * seq_len)
        return
    padding_mask_len = max(0, start_idx - context_len)
    slot_mapping.extend([PAD_SLOT_ID] * padding_mask_len)
    range_start = max(start_idx, context_len)
    block_table = block_tables[seq_id]
    for i in range(range_start, seq_len):
        block_number = block_table[i // block_size]
        block_offset = i % block_size
        slot = block_number * block_size + block_offset
        slot_mapping.append(slot)


# ----------------------------------------------------------------------------------------------
# kernels: torch references of vllm._custom_ops.reshape_and_cache_flash and
# vllm_flash_attn.flash_attn_varlen_func (with and without block_table)
# ----------------------------------------------------------------------------------------------
def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype):
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = key[t]
        value_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = value[t]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, alibi_slopes=None, block_table=None):
    out = torch.empty_like(q)
    num_seqs = cu_seqlens_q.numel() - 1
    for i in range(num_seqs):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        seqlen_q = qe - qs
        seqlen_k = int(cu_seqlens_k[i + 1]) - int(cu_seqlens_k[i])
        if block_table is None:
            ks = int(cu_seqlens_k[i])
            ki, vi = k[ks:ks + seqlen_k], v[ks:ks + seqlen_k]
        else:
            pos = torch.arange(seqlen_k)
            blocks = block_table[i].long()[pos // k.shape[1]]
            ki, vi = k[blocks, pos % k.shape[1]], v[blocks, pos % v.shape[1]]
        qi = q[qs:qe].transpose(0, 1)  # [heads, q, d]
        rep = qi.shape[0] // ki.shape[1]
        ki = ki.transpose(0, 1).repeat_interleave(rep, 0)
        vi = vi.transpose(0, 1).repeat_interleave(rep, 0)
        mask = None
        if causal:  # flash-attn aligns the causal diagonal to the bottom-right corner
            qpos = torch.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
            mask = torch.arange(seqlen_k)[None, :] <= qpos
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale)
        out[qs:qe] = o.transpose(0, 1)
    return out


# ----------------------------------------------------------------------------------------------
# vllm/attention/backends/flash_attn.py
# ----------------------------------------------------------------------------------------------
@dataclass
class FlashAttentionMetadata:
    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor
    seq_lens: Optional[List[int]]
    seq_lens_tensor: Optional[torch.Tensor]
    max_query_len: Optional[int]
    max_prefill_seq_len: int
    max_decode_seq_len: int
    query_start_loc: Optional[torch.Tensor]
    seq_start_loc: Optional[torch.Tensor]
    context_lens_tensor: Optional[torch.Tensor]
    block_tables: Optional[torch.Tensor]
    use_cuda_graph: bool

    @property
    def prefill_metadata(self) -> Optional["FlashAttentionMetadata"]:
        if self.num_prefills == 0:
            return None
        return FlashAttentionMetadata(
            num_prefills=self.num_prefills,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=0,
            slot_mapping=self.slot_mapping[:self.num_prefill_tokens],
            seq_lens=self.seq_lens[:self.num_prefills],
            seq_lens_tensor=self.seq_lens_tensor[:self.num_prefills],
            max_query_len=self.max_query_len,
            max_prefill_seq_len=self.max_prefill_seq_len,
            max_decode_seq_len=0,
            query_start_loc=self.query_start_loc[:self.num_prefills + 1],
            seq_start_loc=self.seq_start_loc[:self.num_prefills + 1],
            context_lens_tensor=self.context_lens_tensor[:self.num_prefills],
            block_tables=self.block_tables[:self.num_prefills],
            use_cuda_graph=False,
        )


class FlashAttentionMetadataBuilder:

    def __init__(self, input_builder: "ModelInputForGPUBuilder"):
        self.slot_mapping: List[int] = []
        self.prefill_seq_lens: List[int] = []
        self.context_lens: List[int] = []
        self.block_tables: List[List[int]] = []
        self.curr_seq_lens: List[int] = []
        self.num_prefills = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0

        self.input_builder = input_builder
        self.sliding_window = input_builder.sliding_window
        self.block_size = input_builder.block_size

    def _add_seq_group(self, inter_data: "InterDataForSeqGroup", chunked_prefill_enabled: bool,
                       prefix_cache_hit: bool = False):
        """Add a sequence group to the metadata. Specifically update/append
        1. context length.
        2. block table.
        3. slot mapping.
        """
        is_prompt = inter_data.is_prompt
        block_tables = inter_data.block_tables

        for (seq_id, token_len, seq_len, curr_seq_len, query_len, context_len,
             curr_sliding_window_block) in zip(
                 inter_data.seq_ids, [len(t) for t in inter_data.input_tokens],
                 inter_data.orig_seq_lens, inter_data.seq_lens,
                 inter_data.query_lens, inter_data.context_lens,
                 inter_data.curr_sliding_window_blocks):
            self.context_lens.append(context_len)

            if is_prompt:
                self.num_prefills += 1
                self.num_prefill_tokens += token_len
                self.prefill_seq_lens.append(seq_len)
            else:
                assert query_len == 1
                self.num_decode_tokens += query_len
                self.curr_seq_lens.append(curr_seq_len)

            # Compute block table.
            # TODO(sang): Combine chunked prefill and prefix caching by
            # only allowing multiple of block_size chunk size.
            # NOTE: This only works for oooooooxxx style attention.
            block_table = []
            if FIXED:
                hit = prefix_cache_hit
            else:
                hit = inter_data.prefix_cache_hit
            if hit:
                # NOTE(woosuk): For flash-attn, the block table should
                # include the entries for the incoming prefill tokens.
                block_table = block_tables[seq_id]
            elif ((chunked_prefill_enabled or not is_prompt)
                  and block_tables is not None):
                block_table = block_tables[seq_id][-curr_sliding_window_block:]
            self.block_tables.append(block_table)

            # Compute slot mapping.
            is_profile_run = is_block_tables_empty(block_tables)
            start_idx = compute_slot_mapping_start_idx(is_prompt, query_len, context_len,
                                                       self.sliding_window)
            compute_slot_mapping(is_profile_run, self.slot_mapping, seq_id, seq_len, context_len,
                                 start_idx, self.block_size, inter_data.block_tables)

    def build(self, seq_lens: List[int], query_lens: List[int], cuda_graph_pad_size: int,
              batch_size: int):
        if FIXED:
            prefix_cache_hit = any([
                inter_data.prefix_cache_hit
                for inter_data in self.input_builder.inter_data_list
            ])
            for inter_data in self.input_builder.inter_data_list:
                self._add_seq_group(inter_data, self.input_builder.chunked_prefill_enabled,
                                    prefix_cache_hit)
        else:
            for inter_data in self.input_builder.inter_data_list:
                self._add_seq_group(inter_data, self.input_builder.chunked_prefill_enabled)

        device = None
        max_query_len = max(query_lens)
        max_prefill_seq_len = max(self.prefill_seq_lens, default=0)
        max_decode_seq_len = max(self.curr_seq_lens, default=0)
        num_decode_tokens = self.num_decode_tokens

        block_tables = make_tensor_with_pad(self.block_tables, pad=0, dtype=torch.int,
                                            device=device)
        context_lens_tensor = torch.tensor(self.context_lens, dtype=torch.int)
        seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int)
        query_lens_tensor = torch.tensor(query_lens, dtype=torch.long)
        query_start_loc = torch.zeros(query_lens_tensor.shape[0] + 1, dtype=torch.int32)
        seq_start_loc = torch.zeros(seq_lens_tensor.shape[0] + 1, dtype=torch.int32)
        torch.cumsum(seq_lens_tensor, dim=0, dtype=seq_start_loc.dtype, out=seq_start_loc[1:])
        torch.cumsum(query_lens_tensor, dim=0, dtype=query_start_loc.dtype,
                     out=query_start_loc[1:])
        slot_mapping_tensor = torch.tensor(self.slot_mapping, dtype=torch.long)

        return FlashAttentionMetadata(
            num_prefills=self.num_prefills,
            slot_mapping=slot_mapping_tensor,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=num_decode_tokens,
            seq_lens=seq_lens,
            seq_lens_tensor=seq_lens_tensor,
            max_query_len=max_query_len,
            max_prefill_seq_len=max_prefill_seq_len,
            max_decode_seq_len=max_decode_seq_len,
            query_start_loc=query_start_loc,
            seq_start_loc=seq_start_loc,
            context_lens_tensor=context_lens_tensor,
            block_tables=block_tables,
            use_cuda_graph=False,
        )


class FlashAttentionImpl:

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes=None,
                 sliding_window=None, kv_cache_dtype="auto"):
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = alibi_slopes
        self.sliding_window = ((sliding_window, sliding_window)
                               if sliding_window is not None else (-1, -1))
        self.kv_cache_dtype = kv_cache_dtype

    def forward(self, query, key, value, kv_cache, attn_metadata: FlashAttentionMetadata):
        num_tokens, hidden_size = query.shape
        query = query.view(-1, self.num_heads, self.head_size)
        key = key.view(-1, self.num_kv_heads, self.head_size)
        value = value.view(-1, self.num_kv_heads, self.head_size)

        if kv_cache is not None:
            key_cache = kv_cache[0]
            value_cache = kv_cache[1]
            # Reshape the input keys and values and store them in the cache.
            # If kv_cache is not provided, the new key and value tensors are
            # not cached. This happens during the initial memory profiling run.
            reshape_and_cache_flash(key, value, key_cache, value_cache,
                                    attn_metadata.slot_mapping.flatten(), self.kv_cache_dtype)

        num_prefill_tokens = attn_metadata.num_prefill_tokens
        output = torch.empty_like(query)
        query = query[:num_prefill_tokens]
        key = key[:num_prefill_tokens]
        value = value[:num_prefill_tokens]

        if prefill_meta := attn_metadata.prefill_metadata:
            # Prompt run.
            if (kv_cache is None or prefill_meta.block_tables is None
                    or prefill_meta.block_tables.numel() == 0):
                # normal attention
                # When block_tables are not filled, it means q and k are the
                # prompt, and they have the same length.
                out = flash_attn_varlen_func(
                    q=query, k=key, v=value,
                    cu_seqlens_q=prefill_meta.seq_start_loc,
                    cu_seqlens_k=prefill_meta.seq_start_loc,
                    max_seqlen_q=prefill_meta.max_prefill_seq_len,
                    max_seqlen_k=prefill_meta.max_prefill_seq_len,
                    softmax_scale=self.scale, causal=True,
                    alibi_slopes=self.alibi_slopes,
                )
                output[:num_prefill_tokens] = out
            else:
                # prefix-enabled attention
                assert prefill_meta.seq_lens is not None
                max_seq_len = max(prefill_meta.seq_lens)
                output[:num_prefill_tokens] = flash_attn_varlen_func(
                    q=query, k=key_cache, v=value_cache,
                    cu_seqlens_q=prefill_meta.query_start_loc,
                    max_seqlen_q=prefill_meta.max_query_len,
                    cu_seqlens_k=prefill_meta.seq_start_loc,
                    max_seqlen_k=max_seq_len,
                    softmax_scale=self.scale, causal=True,
                    alibi_slopes=self.alibi_slopes,
                    block_table=prefill_meta.block_tables,
                )
        return output.view(num_tokens, hidden_size)


# ----------------------------------------------------------------------------------------------
# vllm/model_executor/models/llama.py (trimmed, no tensor parallelism)
# ----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.variance_epsilon) * self.weight


class RotaryEmbedding(nn.Module):  # neox style, as get_rope(is_neox_style=True)
    def __init__(self, head_size, max_position, base):
        super().__init__()
        self.head_size = head_size
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float) / head_size))
        t = torch.arange(max_position, dtype=torch.float)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1),
                             persistent=False)

    def forward(self, positions, query, key):
        cos_sin = self.cos_sin_cache[positions]
        cos, sin = cos_sin.chunk(2, dim=-1)

        def rot(x):
            shape = x.shape
            x = x.view(x.shape[0], -1, self.head_size)
            x1, x2 = x.chunk(2, dim=-1)
            c, s = cos[:, None, :], sin[:, None, :]
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).view(shape)

        return rot(query), rot(key)


class Attention(nn.Module):
    def __init__(self, num_heads, head_size, scale, num_kv_heads):
        super().__init__()
        self.impl = FlashAttentionImpl(num_heads, head_size, scale, num_kv_heads)

    def forward(self, query, key, value, kv_cache, attn_metadata):
        return self.impl.forward(query, key, value, kv_cache, attn_metadata)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.num_heads = self.total_num_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self.hidden_size // self.total_num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(self.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, self.hidden_size, bias=False)
        rope_theta = getattr(config, "rope_theta", 10000)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings,
                                          rope_theta)
        self.attn = Attention(self.num_heads, self.head_dim, self.scaling, self.num_kv_heads)

    def forward(self, positions, hidden_states, kv_cache, attn_metadata):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v, kv_cache, attn_metadata)
        return self.o_proj(attn_output)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden_states, kv_cache, attn_metadata):
        residual = hidden_states
        hidden_states = self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache,
                                       attn_metadata)
        hidden_states = hidden_states + residual
        residual = hidden_states
        gate, up = self.gate_up_proj(self.post_attention_layernorm(hidden_states)).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up) + residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden_states = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            hidden_states = layer(positions, hidden_states, kv_caches[i], attn_metadata)
        return self.norm(hidden_states)

    def compute_logits(self, hidden_states):
        return self.lm_head(hidden_states)


# ----------------------------------------------------------------------------------------------
# vllm/core/block_manager (prefix caching, trimmed) and vllm/worker/model_runner.py
# ----------------------------------------------------------------------------------------------
class PrefixCachingBlockManager:
    def __init__(self, block_size, num_blocks):
        self.block_size = block_size
        self.free = list(range(num_blocks))
        self.cached: Dict[tuple, int] = {}  # hash of all tokens up to the block end -> block
        self.block_tables: Dict[int, List[int]] = {}
        self.computed: Dict[int, List[int]] = {}

    def allocate(self, seq_id, token_ids):
        table, computed = [], []
        for b in range(0, len(token_ids), self.block_size):
            full = b + self.block_size <= len(token_ids)
            key = tuple(token_ids[:b + self.block_size])
            if full and key in self.cached and len(computed) == len(table):
                table.append(self.cached[key])
                computed.append(self.cached[key])
                continue
            blk = self.free.pop(0)
            table.append(blk)
            if full:
                self.cached[key] = blk
        self.block_tables[seq_id] = table
        self.computed[seq_id] = computed

    def get_common_computed_block_ids(self, seq_id):
        return self.computed[seq_id]


@dataclass
class InterDataForSeqGroup:
    request_id: str
    seq_ids: List[int]
    is_prompt: bool
    block_tables: Optional[Dict[int, List[int]]]
    computed_block_nums: List[int]
    input_tokens: List[List[int]] = field(default_factory=list)
    input_positions: List[List[int]] = field(default_factory=list)
    seq_lens: List[int] = field(default_factory=list)
    orig_seq_lens: List[int] = field(default_factory=list)
    query_lens: List[int] = field(default_factory=list)
    context_lens: List[int] = field(default_factory=list)
    curr_sliding_window_blocks: List[int] = field(default_factory=list)
    prefix_cache_hit: bool = False


class ModelInputForGPUBuilder:
    def __init__(self, block_size, sliding_window=None, chunked_prefill_enabled=False):
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.chunked_prefill_enabled = chunked_prefill_enabled
        self.inter_data_list: List[InterDataForSeqGroup] = []
        self.attn_metadata_builder = FlashAttentionMetadataBuilder(self)

    def _compute_lens(self, inter_data, seq_idx, tokens):
        seq_len = len(tokens)
        context_len = 0
        inter_data.seq_lens.append(seq_len)
        inter_data.orig_seq_lens.append(seq_len)
        inter_data.context_lens.append(context_len)
        inter_data.input_tokens.append(list(tokens[context_len:seq_len]))
        inter_data.input_positions.append(list(range(context_len, seq_len)))
        inter_data.query_lens.append(seq_len - context_len)
        inter_data.curr_sliding_window_blocks.append(0)

    def _compute_for_prefix_cache_hit(self, inter_data, seq_idx):
        """Check if hit prefix cache (i.e., some blocks are already computed).
        If hit, update input tokens and positions to only compute the
        remaining blocks.
        """
        computed_block_nums = inter_data.computed_block_nums

        # Note that prefix caching does not support sliding window.
        prefix_cache_hit = (computed_block_nums is not None
                            and len(computed_block_nums) > 0
                            and self.sliding_window is None
                            and inter_data.is_prompt)
        inter_data.prefix_cache_hit = prefix_cache_hit
        if self.chunked_prefill_enabled and prefix_cache_hit:
            raise RuntimeError("chunked prefill cannot be used with prefix caching now.")

        # If prefix cache is hit, advance context length to bypass
        # hit blocks. Accordingly, input tokens, position and query length
        # have to be updated.
        if prefix_cache_hit:
            context_len = len(computed_block_nums) * self.block_size
            inter_data.input_tokens[seq_idx] = inter_data.input_tokens[seq_idx][context_len:]
            inter_data.input_positions[seq_idx] = inter_data.input_positions[seq_idx][context_len:]
            inter_data.context_lens[seq_idx] = context_len
            inter_data.query_lens[seq_idx] = inter_data.seq_lens[seq_idx] - context_len

    def add_seq_group(self, request_id, seq_id, tokens, block_manager):
        inter_data = InterDataForSeqGroup(
            request_id=request_id, seq_ids=[seq_id], is_prompt=True,
            block_tables={seq_id: block_manager.block_tables[seq_id]},
            computed_block_nums=block_manager.get_common_computed_block_ids(seq_id))
        self.inter_data_list.append(inter_data)
        self._compute_lens(inter_data, 0, tokens)
        self._compute_for_prefix_cache_hit(inter_data, 0)

    def build(self):
        input_tokens = [t for d in self.inter_data_list for toks in d.input_tokens for t in toks]
        input_positions = [p for d in self.inter_data_list for ps in d.input_positions for p in ps]
        seq_lens = [s for d in self.inter_data_list for s in d.seq_lens]
        query_lens = [q for d in self.inter_data_list for q in d.query_lens]
        attn_metadata = self.attn_metadata_builder.build(seq_lens, query_lens, -1,
                                                         len(input_tokens))
        return (torch.tensor(input_tokens), torch.tensor(input_positions), query_lens,
                attn_metadata)


def execute_model(model, kv_caches, block_manager, requests):
    builder = ModelInputForGPUBuilder(BLOCK_SIZE)
    for request_id, seq_id, tokens in requests:
        block_manager.allocate(seq_id, tokens)
        builder.add_seq_group(request_id, seq_id, tokens, block_manager)
    input_ids, positions, query_lens, attn_metadata = builder.build()
    hidden_states = model(input_ids, positions, kv_caches, attn_metadata)
    # sampler: the last token of every prompt
    last = torch.tensor(list(accumulate(query_lens))) - 1
    return model.compute_logits(hidden_states[last])


def main():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, rms_norm_eps=1e-6)
    model = LlamaForCausalLM(config).eval()
    head_dim = config.hidden_size // config.num_attention_heads
    kv_caches = [torch.zeros(2, NUM_GPU_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, head_dim)
                 for _ in range(config.num_hidden_layers)]
    block_manager = PrefixCachingBlockManager(BLOCK_SIZE, NUM_GPU_BLOCKS)

    system_prompt = [1, 17, 23, 5, 42, 8, 31, 12]
    req0 = system_prompt + [50, 3, 9]
    req1 = system_prompt + [27, 44, 6, 19]
    req2 = [60, 11, 36, 2, 48, 25]

    with torch.no_grad():
        logits0 = execute_model(model, kv_caches, block_manager, [("req-0", 0, req0)])
        logits12 = execute_model(model, kv_caches, block_manager,
                                 [("req-1", 1, req1), ("req-2", 2, req2)])

    print("block tables:", block_manager.block_tables)
    for name, lg in (("req-0", logits0[0]), ("req-1", logits12[0]), ("req-2", logits12[1])):
        print(f"{name}: next token {int(lg.argmax())}  logits[:6] {lg[:6].numpy().round(4)}")


if __name__ == "__main__":
    main()
