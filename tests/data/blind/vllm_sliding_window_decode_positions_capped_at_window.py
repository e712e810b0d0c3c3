# vllm-project/vllm#2088 ("[BugFix] Fix input positions for long context with sliding window", fixes #2059 and
# #2064: Mistral/Mixtral generate nonsense past 4096 tokens). vllm/worker/model_runner.py ModelRunner._prepare_decode
# capped the context length at the sliding window first and then took the decode token's position as
# `context_len - 1`, so once a sequence was longer than the window every new token got position window - 1 (its
# rotary angle) and was written to the slot of position window - 1 of the block table (the same cache slot each
# step), while the paged-attention kernel read the last window's blocks with context_len = window.
# The fix takes `position = seq_len - 1` from the uncapped length and caps only the context length given to the kernel.
#
# Ported at tiny sizes on the CPU: BlockSpaceManager (sliding-window block re-use), ModelRunner._prepare_prompt /
# _prepare_decode, PagedAttention (xformers BlockDiagonalCausalMask.make_local_attention on prompts, the
# paged_attention_v1 kernel's reference loop on decode), reshape_and_cache, and vllm's Mistral model, config from
# transformers.MistralConfig. Greedy generation of two sequences that grow past the window.
import sys
import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import MistralConfig

FIXED = "--fixed" in sys.argv

_PAD_SLOT_ID = -1


# ---------------------------------------------------------------- vllm/sequence.py (trimmed)

class SequenceData:

    def __init__(self, prompt_token_ids: List[int]) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: List[int] = []

    def append_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def get_len(self) -> int:
        return len(self.output_token_ids) + len(self.prompt_token_ids)

    def get_token_ids(self) -> List[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_last_token_id(self) -> int:
        if not self.output_token_ids:
            return self.prompt_token_ids[-1]
        return self.output_token_ids[-1]


class Sequence:

    def __init__(self, seq_id: int, prompt_token_ids: List[int], block_size: int) -> None:
        self.seq_id = seq_id
        self.block_size = block_size
        self.data = SequenceData(prompt_token_ids)

    @property
    def num_logical_blocks(self) -> int:
        return (self.data.get_len() + self.block_size - 1) // self.block_size

    def append_token_id(self, token_id: int) -> None:
        self.data.append_token_id(token_id)


class SequenceGroupMetadata:

    def __init__(self, request_id: str, is_prompt: bool, seq_data: Dict[int, SequenceData],
                 block_tables: Optional[Dict[int, List[int]]]) -> None:
        self.request_id = request_id
        self.is_prompt = is_prompt
        self.seq_data = seq_data
        self.block_tables = block_tables


# ---------------------------------------------------------------- vllm/core/block_manager.py (trimmed)

class PhysicalTokenBlock:

    def __init__(self, block_number: int) -> None:
        self.block_number = block_number
        self.ref_count = 0


class BlockAllocator:

    def __init__(self, num_blocks: int) -> None:
        self.free_blocks = [PhysicalTokenBlock(i) for i in range(num_blocks)]

    def allocate(self) -> PhysicalTokenBlock:
        block = self.free_blocks.pop(0)
        block.ref_count = 1
        return block


class BlockSpaceManager:

    def __init__(self, block_size: int, num_gpu_blocks: int, sliding_window: Optional[int] = None) -> None:
        self.block_size = block_size
        self.block_sliding_window = None
        if sliding_window is not None:
            assert sliding_window % block_size == 0, (sliding_window, block_size)
            self.block_sliding_window = sliding_window // block_size
        self.gpu_allocator = BlockAllocator(num_gpu_blocks)
        self.block_tables: Dict[int, List[PhysicalTokenBlock]] = {}

    def allocate(self, seq: Sequence) -> None:
        block_table: List[PhysicalTokenBlock] = []
        for logical_idx in range(seq.num_logical_blocks):
            if (self.block_sliding_window is not None
                    and logical_idx >= self.block_sliding_window):
                block = block_table[logical_idx % self.block_sliding_window]
            else:
                block = self.gpu_allocator.allocate()
            block.ref_count = 1
            block_table.append(block)
        self.block_tables[seq.seq_id] = block_table.copy()

    def append_slot(self, seq: Sequence) -> None:
        """Allocate a physical slot for a new token."""
        block_table = self.block_tables[seq.seq_id]
        if len(block_table) < seq.num_logical_blocks:
            if (self.block_sliding_window
                    and len(block_table) >= self.block_sliding_window):
                # re-use a block
                block_table.append(block_table[len(block_table) %
                                               self.block_sliding_window])
            else:
                # The sequence has a new logical block.
                # Allocate a new physical block.
                block = self.gpu_allocator.allocate()
                block_table.append(block)

    def get_block_table(self, seq: Sequence) -> List[int]:
        return [block.block_number for block in self.block_tables[seq.seq_id]]


# ---------------------------------------------------------------- vllm/model_executor/input_metadata.py

class InputMetadata:

    def __init__(self, prompt_lens: List[int], slot_mapping: torch.Tensor, max_context_len: Optional[int],
                 context_lens: Optional[torch.Tensor], block_tables: Optional[torch.Tensor]) -> None:
        self.prompt_lens = prompt_lens
        self.max_context_len = max_context_len
        self.slot_mapping = slot_mapping
        self.context_lens = context_lens
        self.block_tables = block_tables
        self.is_prompt = len(prompt_lens) > 0
        # Set during the execution of the first attention op.
        self.attn_bias = None


# ---------------------------------------------------------------- xformers.ops.fmha.attn_bias, CPU stand-in

class BlockDiagonalCausalMask:

    def __init__(self, seqlens: List[int], window_size: Optional[int] = None) -> None:
        self.seqlens = seqlens
        self.window_size = window_size

    @classmethod
    def from_seqlens(cls, seqlens: List[int]) -> "BlockDiagonalCausalMask":
        return cls(list(seqlens))

    def make_local_attention(self, window_size: int) -> "BlockDiagonalCausalMask":
        return BlockDiagonalCausalMask(self.seqlens, window_size)

    def materialize(self, dtype=torch.float32) -> torch.Tensor:
        total = sum(self.seqlens)
        bias = torch.full((total, total), float("-inf"), dtype=dtype)
        start = 0
        for n in self.seqlens:
            i = torch.arange(n)[:, None]
            j = torch.arange(n)[None, :]
            keep = j <= i
            if self.window_size is not None:
                keep = keep & (i - j < self.window_size)
            bias[start:start + n, start:start + n].masked_fill_(keep, 0.0)
            start += n
        return bias


def memory_efficient_attention_forward(query, key, value, attn_bias, p=0.0, scale=None):
    # query/key/value: [1, total_tokens, num_heads, head_size]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores + attn_bias.materialize(scores.dtype)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(0, 1).contiguous().unsqueeze(0)


# ---------------------------------------------------------------- csrc cache_ops / attention_ops, reference loops

def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    # key_cache: [num_blocks, num_kv_heads, head_size // x, block_size, x]
    # value_cache: [num_blocks, num_kv_heads, head_size, block_size]
    block_size = key_cache.shape[3]
    x = key_cache.shape[4]
    for token_idx in range(key.shape[0]):
        slot = int(slot_mapping[token_idx])
        if slot < 0:
            # Padding token that should be ignored.
            continue
        block_idx = slot // block_size
        block_offset = slot % block_size
        key_cache[block_idx, :, :, block_offset, :] = key[token_idx].view(key.shape[1], -1, x)
        value_cache[block_idx, :, :, block_offset] = value[token_idx]


def paged_attention_v1(out, query, key_cache, value_cache, head_mapping, scale, block_tables,
                       context_lens, block_size, max_context_len, alibi_slopes):
    num_seqs = query.shape[0]
    num_kv_heads = value_cache.shape[1]
    head_size = value_cache.shape[2]
    for i in range(num_seqs):
        q = query[i]
        block_table = block_tables[i]
        context_len = int(context_lens[i])
        keys = []
        values = []
        for j in range(context_len):
            block_number = int(block_table[j // block_size])
            block_offset = j % block_size
            k = key_cache[block_number, :, :, block_offset, :].reshape(num_kv_heads, head_size)
            keys.append(k)
            v = value_cache[block_number, :, :, block_offset]
            values.append(v)
        keys = torch.stack(keys, dim=0)[:, head_mapping]
        values = torch.stack(values, dim=0)[:, head_mapping]
        attn = torch.einsum("hd,khd->hk", q, keys) * scale
        attn = torch.softmax(attn, dim=-1)
        out[i] = torch.einsum("hk,khd->hd", attn, values)


# ---------------------------------------------------------------- vllm/model_executor/layers/attention.py

class PagedAttention(nn.Module):

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 alibi_slopes: Optional[List[float]] = None, sliding_window: Optional[int] = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.sliding_window = sliding_window
        self.alibi_slopes = alibi_slopes
        assert self.num_heads % self.num_kv_heads == 0
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.head_mapping = torch.repeat_interleave(
            torch.arange(self.num_kv_heads, dtype=torch.int32), self.num_queries_per_kv).long()

    def forward(self, query, key, value, key_cache, value_cache, input_metadata: InputMetadata):
        batch_size, seq_len, hidden_size = query.shape
        # Reshape the query, key, and value tensors.
        query = query.view(-1, self.num_heads, self.head_size)
        key = key.view(-1, self.num_kv_heads, self.head_size)
        value = value.view(-1, self.num_kv_heads, self.head_size)

        # Reshape the keys and values and store them in the cache.
        if key_cache is not None and value_cache is not None:
            reshape_and_cache(key, value, key_cache, value_cache,
                              input_metadata.slot_mapping.flatten())

        if input_metadata.is_prompt:
            # Prompt run.
            if self.num_kv_heads != self.num_heads:
                # As of Nov 2023, xformers only supports MHA. For MQA/GQA,
                # project the key and value tensors to the desired number of
                # heads.
                key = key[:, :, None, :].expand(key.shape[0], self.num_kv_heads,
                                                self.num_queries_per_kv, key.shape[-1])
                value = value[:, :, None, :].expand(value.shape[0], self.num_kv_heads,
                                                    self.num_queries_per_kv, value.shape[-1])
                key = key.reshape(key.shape[0], self.num_heads, self.head_size)
                value = value.reshape(value.shape[0], self.num_heads, self.head_size)

            # Set attention bias if not provided. This typically happens at the
            # very attention layer of every iteration.
            if input_metadata.attn_bias is None:
                attn_bias = BlockDiagonalCausalMask.from_seqlens([seq_len] * batch_size)
                if self.sliding_window is not None:
                    attn_bias = attn_bias.make_local_attention(self.sliding_window)
                input_metadata.attn_bias = attn_bias

            query = query.unsqueeze(0)
            key = key.unsqueeze(0)
            value = value.unsqueeze(0)
            out = memory_efficient_attention_forward(query, key, value,
                                                     attn_bias=input_metadata.attn_bias,
                                                     p=0.0, scale=self.scale)
            output = out.view_as(query)
        else:
            # Decoding run.
            output = torch.empty_like(query)
            block_size = value_cache.shape[3]
            paged_attention_v1(output, query, key_cache, value_cache, self.head_mapping, self.scale,
                               input_metadata.block_tables, input_metadata.context_lens, block_size,
                               input_metadata.max_context_len, self.alibi_slopes)

        # Reshape the output tensor.
        return output.view(batch_size, seq_len, hidden_size)


# ---------------------------------------------------------------- vllm/model_executor/layers (rotary, norm, act)

class RotaryEmbedding(nn.Module):

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: int,
                 is_neox_style: bool) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions, query, key):
        query = query.view(*query.shape[:-1], -1, self.head_size)
        key = key.view(*key.shape[:-1], -1, self.head_size)
        cos_sin = self.cos_sin_cache[positions]
        cos, sin = cos_sin.chunk(2, dim=-1)
        cos = cos.repeat(1, 1, 2).unsqueeze(-2)
        sin = sin.repeat(1, 1, 2).unsqueeze(-2)

        def rotate_neox(x):
            x1 = x[..., :x.shape[-1] // 2]
            x2 = x[..., x.shape[-1] // 2:]
            return torch.cat((-x2, x1), dim=-1)

        query = query * cos + rotate_neox(query) * sin
        key = key * cos + rotate_neox(key) * sin
        return query.flatten(-2), key.flatten(-2)


def get_rope(head_size, rotary_dim, max_position, base, is_neox_style=True):
    return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style)


class RMSNorm(nn.Module):

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        out = x * torch.rsqrt(variance + self.variance_epsilon) * self.weight
        if residual is None:
            return out
        return out, residual


class SiluAndMul(nn.Module):

    def forward(self, x):
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


# ---------------------------------------------------------------- vllm/model_executor/models/mistral.py

class MistralMLP(nn.Module):

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class MistralAttention(nn.Module):

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, max_position: int = 4096 * 32,
                 rope_theta: float = 10000, sliding_window: Optional[int] = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        self.rope_theta = rope_theta
        self.sliding_window = sliding_window

        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden_size, bias=False)
        self.rotary_emb = get_rope(self.head_dim, rotary_dim=self.head_dim, max_position=max_position,
                                   base=self.rope_theta)
        self.attn = PagedAttention(self.num_heads, self.head_dim, self.scaling,
                                   num_kv_heads=self.num_kv_heads, sliding_window=self.sliding_window)

    def forward(self, positions, hidden_states, kv_cache, input_metadata):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        k_cache, v_cache = kv_cache
        attn_output = self.attn(q, k, v, k_cache, v_cache, input_metadata)
        return self.o_proj(attn_output)


class MistralDecoderLayer(nn.Module):

    def __init__(self, config: MistralConfig) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        rope_theta = getattr(config, "rope_theta", 10000)
        self.self_attn = MistralAttention(hidden_size=self.hidden_size,
                                          num_heads=config.num_attention_heads,
                                          max_position=config.max_position_embeddings,
                                          num_kv_heads=config.num_key_value_heads,
                                          rope_theta=rope_theta,
                                          sliding_window=config.sliding_window)
        self.mlp = MistralMLP(hidden_size=self.hidden_size, intermediate_size=config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, kv_cache, input_metadata, residual):
        # Self Attention
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states,
                                       kv_cache=kv_cache, input_metadata=input_metadata)

        # Fully Connected
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class MistralModel(nn.Module):

    def __init__(self, config: MistralConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([MistralDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, input_metadata):
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for i in range(len(self.layers)):
            layer = self.layers[i]
            hidden_states, residual = layer(positions, hidden_states, kv_caches[i], input_metadata, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class MistralForCausalLM(nn.Module):

    def __init__(self, config: MistralConfig) -> None:
        super().__init__()
        self.config = config
        self.model = MistralModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, kv_caches, input_metadata):
        return self.model(input_ids, positions, kv_caches, input_metadata)

    def sample(self, hidden_states, selected_token_indices):
        hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
        hidden_states = hidden_states.index_select(0, selected_token_indices)
        logits = torch.matmul(hidden_states, self.lm_head.weight.t())
        return logits


# ---------------------------------------------------------------- vllm/worker/model_runner.py

def _make_tensor_with_pad(x: List[List[int]], max_len: int, pad: int, dtype: torch.dtype) -> torch.Tensor:
    padded_x = [x_i + [pad] * (max_len - len(x_i)) for x_i in x]
    return torch.tensor(padded_x, dtype=dtype)


class ModelRunner:

    def __init__(self, model: MistralForCausalLM, sliding_window: Optional[int], block_size: int,
                 kv_caches) -> None:
        self.model = model
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.kv_caches = kv_caches

    def _prepare_prompt(self, seq_group_metadata_list: List[SequenceGroupMetadata]):
        assert len(seq_group_metadata_list) > 0
        input_tokens: List[List[int]] = []
        input_positions: List[List[int]] = []
        slot_mapping: List[List[int]] = []

        prompt_lens: List[int] = []
        for seq_group_metadata in seq_group_metadata_list:
            assert seq_group_metadata.is_prompt
            seq_ids = list(seq_group_metadata.seq_data.keys())
            assert len(seq_ids) == 1
            seq_id = seq_ids[0]

            seq_data = seq_group_metadata.seq_data[seq_id]
            prompt_tokens = seq_data.get_token_ids()
            prompt_len = len(prompt_tokens)
            prompt_lens.append(prompt_len)

            input_tokens.append(prompt_tokens)
            # NOTE(woosuk): Here we assume that the first token in the prompt
            # is always the first token in the sequence.
            input_positions.append(list(range(prompt_len)))

            # Compute the slot mapping.
            slot_mapping.append([])
            block_table = seq_group_metadata.block_tables[seq_id]
            # Mask the [0, start_idx) tokens of the prompt with _PAD_SLOT_ID,
            # where start_idx is max(0, prompt_len - sliding_window).
            # For example, if the prompt len is 10, sliding window is 8, and
            # block size is 4, the first two tokens are masked and the slot
            # mapping will be [-1, -1, 2, 3, 4, 5, 6, 7, 0, 1].
            start_idx = 0
            if self.sliding_window is not None:
                start_idx = max(0, prompt_len - self.sliding_window)
            for i in range(prompt_len):
                if i < start_idx:
                    slot_mapping[-1].append(_PAD_SLOT_ID)
                    continue

                block_number = block_table[i // self.block_size]
                block_offset = i % self.block_size
                slot = block_number * self.block_size + block_offset
                slot_mapping[-1].append(slot)

        max_prompt_len = max(prompt_lens)
        input_tokens = _make_tensor_with_pad(input_tokens, max_prompt_len, pad=0, dtype=torch.long)
        input_positions = _make_tensor_with_pad(input_positions, max_prompt_len, pad=0, dtype=torch.long)
        slot_mapping = _make_tensor_with_pad(slot_mapping, max_prompt_len, pad=_PAD_SLOT_ID, dtype=torch.long)

        input_metadata = InputMetadata(
            prompt_lens=prompt_lens,
            slot_mapping=slot_mapping,
            max_context_len=None,
            context_lens=None,
            block_tables=None,
        )
        return input_tokens, input_positions, input_metadata

    def _prepare_decode(self, seq_group_metadata_list: List[SequenceGroupMetadata]):
        assert len(seq_group_metadata_list) > 0
        input_tokens: List[List[int]] = []
        input_positions: List[List[int]] = []
        slot_mapping: List[List[int]] = []
        context_lens: List[int] = []
        block_tables: List[List[int]] = []

        for seq_group_metadata in seq_group_metadata_list:
            assert not seq_group_metadata.is_prompt

            seq_ids = list(seq_group_metadata.seq_data.keys())
            for seq_id in seq_ids:
                seq_data = seq_group_metadata.seq_data[seq_id]
                generation_token = seq_data.get_last_token_id()
                input_tokens.append([generation_token])

                if FIXED:
                    seq_len = seq_data.get_len()
                    position = seq_len - 1
                    input_positions.append([position])

                    context_len = seq_len if self.sliding_window is None else min(
                        seq_len, self.sliding_window)
                    context_lens.append(context_len)
                else:
                    context_len = seq_data.get_len()
                    if self.sliding_window is not None:
                        context_len = min(context_len, self.sliding_window)
                    context_lens.append(context_len)

                    position = context_len - 1
                    input_positions.append([position])

                block_table = seq_group_metadata.block_tables[seq_id]
                block_number = block_table[position // self.block_size]
                block_offset = position % self.block_size
                slot = block_number * self.block_size + block_offset
                slot_mapping.append([slot])

                if self.sliding_window is not None:
                    sliding_window_blocks = (self.sliding_window //
                                             self.block_size)
                    block_table = block_table[-sliding_window_blocks:]
                block_tables.append(block_table)

        input_tokens = _make_tensor_with_pad(input_tokens, max_len=1, pad=0, dtype=torch.long)
        input_positions = _make_tensor_with_pad(input_positions, max_len=1, pad=0, dtype=torch.long)
        slot_mapping = _make_tensor_with_pad(slot_mapping, max_len=1, pad=_PAD_SLOT_ID, dtype=torch.long)
        max_context_len = max(context_lens)
        context_lens = torch.tensor(context_lens, dtype=torch.int)
        max_block_table_len = max(len(t) for t in block_tables)
        block_tables = _make_tensor_with_pad(block_tables, max_len=max_block_table_len, pad=0, dtype=torch.int)

        input_metadata = InputMetadata(
            prompt_lens=[],
            slot_mapping=slot_mapping,
            max_context_len=max_context_len,
            context_lens=context_lens,
            block_tables=block_tables,
        )
        return input_tokens, input_positions, input_metadata

    def _prepare_sample(self, seq_group_metadata_list, prompt_lens: List[int]) -> torch.Tensor:
        selected_token_indices: List[int] = []
        selected_token_start_idx = 0
        max_prompt_len = max(prompt_lens) if prompt_lens else 1
        for i, seq_group_metadata in enumerate(seq_group_metadata_list):
            seq_ids = list(seq_group_metadata.seq_data.keys())
            if seq_group_metadata.is_prompt:
                prompt_len = prompt_lens[i]
                selected_token_indices.append(selected_token_start_idx + prompt_len - 1)
                selected_token_start_idx += max_prompt_len
            else:
                num_seqs = len(seq_ids)
                selected_token_indices.extend(
                    range(selected_token_start_idx, selected_token_start_idx + num_seqs))
                selected_token_start_idx += num_seqs
        return torch.tensor(selected_token_indices, dtype=torch.long)

    @torch.inference_mode()
    def execute_model(self, seq_group_metadata_list: List[SequenceGroupMetadata]):
        # NOTE: We assume that all sequences in the group are all prompts or
        # all decodes.
        is_prompt = seq_group_metadata_list[0].is_prompt
        if is_prompt:
            input_tokens, input_positions, input_metadata = self._prepare_prompt(seq_group_metadata_list)
        else:
            input_tokens, input_positions, input_metadata = self._prepare_decode(seq_group_metadata_list)
        selected_token_indices = self._prepare_sample(seq_group_metadata_list, input_metadata.prompt_lens)

        hidden_states = self.model(input_ids=input_tokens, positions=input_positions,
                                   kv_caches=self.kv_caches, input_metadata=input_metadata)
        logits = self.model.sample(hidden_states, selected_token_indices)
        return logits


# ---------------------------------------------------------------- engine: greedy generation, trimmed LLMEngine.step

def main():
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=8)
    block_size = 4
    num_gpu_blocks = 16
    model = MistralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)

    # CacheEngine: key_cache [num_blocks, num_kv_heads, head_size // x, block_size, x].
    head_size = config.hidden_size // config.num_attention_heads
    x = 16 // torch.tensor([], dtype=torch.float32).element_size()
    kv_caches = []
    for _ in range(config.num_hidden_layers):
        key_cache = torch.zeros(num_gpu_blocks, config.num_key_value_heads, head_size // x, block_size, x)
        value_cache = torch.zeros(num_gpu_blocks, config.num_key_value_heads, head_size, block_size)
        kv_caches.append((key_cache, value_cache))

    sliding_window = config.sliding_window
    block_manager = BlockSpaceManager(block_size, num_gpu_blocks, sliding_window=sliding_window)
    runner = ModelRunner(model, sliding_window, block_size, kv_caches)

    prompts = [[5, 17, 33, 2, 61], [11, 4, 90, 23, 7, 48, 36, 19, 72, 3]]
    seqs = [Sequence(i, p, block_size) for i, p in enumerate(prompts)]
    max_tokens = 10

    # Prompt step.
    for seq in seqs:
        block_manager.allocate(seq)
    metadata = [SequenceGroupMetadata(str(s.seq_id), True, {s.seq_id: s.data},
                                      {s.seq_id: block_manager.get_block_table(s)}) for s in seqs]
    logits = runner.execute_model(metadata)
    for seq, row in zip(seqs, logits):
        seq.append_token_id(int(row.argmax()))

    # Decode steps.
    last_logits = None
    for _ in range(max_tokens - 1):
        for seq in seqs:
            block_manager.append_slot(seq)
        metadata = [SequenceGroupMetadata(str(s.seq_id), False, {s.seq_id: s.data},
                                          {s.seq_id: block_manager.get_block_table(s)}) for s in seqs]
        logits = runner.execute_model(metadata)
        for seq, row in zip(seqs, logits):
            seq.append_token_id(int(row.argmax()))
        last_logits = logits

    for seq in seqs:
        print(f"seq {seq.seq_id}: prompt {seq.data.prompt_token_ids} -> output {seq.data.output_token_ids}")
    print("last step logits (first 6 of each row):")
    print(last_logits[:, :6])


if __name__ == "__main__":
    main()
