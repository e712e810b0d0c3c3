"""nano-vllm (GeeeekExplorer/nano-vllm), a small vLLM-style engine, shrunk to CPU.

Correct program (quiet batch quiet-r149a). Ported from GeeeekExplorer/nano-vllm
@bb823b3e06983d71485a8e1f23715ebd87d98ef8 (after #218, "fix chunked prefill bugs and refactor"):
  nanovllm/engine/sequence.py       Sequence (block_table, num_cached_tokens, num_scheduled_tokens)
  nanovllm/engine/block_manager.py  Block / BlockManager (hash-chained prefix caching, can_allocate,
                                    allocate, deallocate, may_append, hash_blocks)
  nanovllm/engine/scheduler.py      Scheduler.schedule (prefill first, chunked prefill for the first
                                    waiting sequence only, then decode with preemption), postprocess
  nanovllm/engine/model_runner.py   ModelRunner.prepare_block_tables / prepare_prefill / prepare_decode
                                    / run, allocate_kv_cache layout (2, layers, blocks, block_size, kv, d)
  nanovllm/utils/context.py         Context / set_context / get_context / reset_context
  nanovllm/layers/attention.py      store_kvcache, Attention.forward (varlen prefill, block_table
                                    when any key was cached before, flash_attn_with_kvcache decode)
  nanovllm/models/qwen3.py, layers/{linear,rotary_embedding,layernorm,embed_head,sampler}.py,
  utils/loader.py (packed_modules_mapping weight loading)

Changes for CPU: tensor parallel size 1 (no torch.distributed), no CUDA graphs or torch.compile,
the Triton store_kvcache kernel is an indexed copy, flash_attn_varlen_func and
flash_attn_with_kvcache are torch stand-ins with flash-attn's semantics (one SDPA call per
cu_seqlens segment, causal aligned bottom-right, keys gathered through the block table),
xxhash is replaced by blake2b, kvcache_block_size is 4 instead of a multiple of 256, and the
weights come from a random tiny transformers Qwen3ForCausalLM in float64 instead of safetensors.

The run: two waves of requests sharing a system prompt (the second wave hits the prefix cache of
blocks hashed by the first), a token budget small enough that long prompts are prefilled in
chunks, and a KV pool small enough that decoding preempts requests, which are later recomputed
(partly from cached blocks). Checked against transformers' Qwen3ForCausalLM run on each finished
sequence alone with no cache: the logits the engine sampled every token from must match.
"""
import hashlib
import sys
from collections import deque
from copy import copy
from dataclasses import dataclass
from enum import Enum, auto
from itertools import count

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM as HFQwen3ForCausalLM

torch.set_default_dtype(torch.float64)


# ---------------------------------------------------------------- nanovllm/sampling_params.py

@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self):
        assert self.temperature > 1e-10, "greedy sampling is not permitted"


# ---------------------------------------------------------------- nanovllm/config.py

@dataclass(slots=True)
class Config:
    hf_config: Qwen3Config
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    enforce_eager: bool = True
    eos: int = -1
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1

    def __post_init__(self):
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)


# ---------------------------------------------------------------- nanovllm/engine/sequence.py

class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    block_size = 256
    counter = count()

    def __init__(self, token_ids: list[int], sampling_params=SamplingParams()):
        self.seq_id = next(Sequence.counter)
        self.status = SequenceStatus.WAITING
        self.token_ids = copy(token_ids)
        self.last_token = token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.is_prefill = True
        self.block_table = []
        self.temperature = sampling_params.temperature
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos

    def __len__(self):
        return self.num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def is_finished(self):
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self):
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self):
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self):
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self):
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i):
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size: (i + 1) * self.block_size]

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


# ---------------------------------------------------------------- nanovllm/engine/block_manager.py

class Block:

    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids = []

    def update(self, hash: int, token_ids: list[int]):
        self.hash = hash
        self.token_ids = token_ids

    def reset(self):
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class BlockManager:

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = dict()
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.num_prefix_hits = 0

    @classmethod
    def compute_hash(cls, token_ids: list[int], prefix: int = -1):
        h = hashlib.blake2b(digest_size=8)   # xxhash.xxh64() upstream
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes())
        return int.from_bytes(h.digest(), "little")

    def _allocate_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def _deallocate_block(self, block_id: int):
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: Sequence) -> int:
        h = -1
        num_cached_blocks = 0
        num_new_blocks = seq.num_blocks
        for i in range(seq.num_blocks - 1):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            num_cached_blocks += 1
            if block_id in self.used_block_ids:
                num_new_blocks -= 1
        if len(self.free_block_ids) < num_new_blocks:
            return -1
        return num_cached_blocks

    def allocate(self, seq: Sequence, num_cached_blocks: int):
        assert not seq.block_table
        h = -1
        for i in range(num_cached_blocks):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block_id = self.hash_to_block_id[h]
            block = self.blocks[block_id]
            if block_id in self.used_block_ids:
                block.ref_count += 1
            else:
                block.ref_count = 1
                self.free_block_ids.remove(block_id)
                self.used_block_ids.add(block_id)
            seq.block_table.append(block_id)
        for i in range(num_cached_blocks, seq.num_blocks):
            seq.block_table.append(self._allocate_block())
        seq.num_cached_tokens = num_cached_blocks * self.block_size
        self.num_prefix_hits += num_cached_blocks

    def deallocate(self, seq: Sequence):
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: Sequence):
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._allocate_block())

    def hash_blocks(self, seq: Sequence):
        start = seq.num_cached_tokens // self.block_size
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        if start == end:
            return
        h = self.blocks[seq.block_table[start - 1]].hash if start > 0 else -1
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block.update(h, token_ids)
            self.hash_to_block_id[h] = block.block_id


# ---------------------------------------------------------------- nanovllm/engine/scheduler.py

class Scheduler:

    def __init__(self, config: Config):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos = config.eos
        self.block_size = config.kvcache_block_size
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_chunked_prefills = 0

    def is_finished(self):
        return not self.waiting and not self.running

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        scheduled_seqs = []
        num_batched_tokens = 0

        # prefill
        while self.waiting and len(scheduled_seqs) < self.max_num_seqs:
            seq = self.waiting[0]
            remaining = self.max_num_batched_tokens - num_batched_tokens
            if remaining == 0:
                break
            if not seq.block_table:
                num_cached_blocks = self.block_manager.can_allocate(seq)
                if num_cached_blocks == -1:
                    break
                num_tokens = seq.num_tokens - num_cached_blocks * self.block_size
            else:
                num_tokens = seq.num_tokens - seq.num_cached_tokens
            if remaining < num_tokens and scheduled_seqs:  # only allow chunked prefill for the first seq
                break
            if not seq.block_table:
                self.block_manager.allocate(seq, num_cached_blocks)
            seq.num_scheduled_tokens = min(num_tokens, remaining)
            num_batched_tokens += seq.num_scheduled_tokens
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                seq.status = SequenceStatus.RUNNING
                self.waiting.popleft()
                self.running.append(seq)
            else:
                self.num_chunked_prefills += 1
            scheduled_seqs.append(seq)

        if scheduled_seqs:
            return scheduled_seqs, True

        # decode
        while self.running and len(scheduled_seqs) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                seq.is_prefill = False
                self.block_manager.may_append(seq)
                scheduled_seqs.append(seq)
        assert scheduled_seqs
        self.running.extendleft(reversed(scheduled_seqs))
        return scheduled_seqs, False

    def preempt(self, seq: Sequence):
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        seq.is_prefill = True
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool):
        for seq, token_id in zip(seqs, token_ids):
            self.block_manager.hash_blocks(seq)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if is_prefill and seq.num_cached_tokens < seq.num_tokens:
                continue
            seq.append_token(token_id)
            if (not seq.ignore_eos and token_id == self.eos) or seq.num_completion_tokens == seq.max_tokens:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)


# ---------------------------------------------------------------- nanovllm/utils/context.py

@dataclass(slots=True)
class Context:
    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None


_CONTEXT = Context()


def get_context():
    return _CONTEXT


def set_context(is_prefill, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                slot_mapping=None, context_lens=None, block_tables=None):
    global _CONTEXT
    _CONTEXT = Context(is_prefill, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       slot_mapping, context_lens, block_tables)


def reset_context():
    global _CONTEXT
    _CONTEXT = Context()


# ---------------------------------------------------------------- flash_attn stand-ins (CPU)

def _gather_paged(cache: torch.Tensor, block_table_row: torch.Tensor, seqlen: int) -> torch.Tensor:
    # cache: (num_blocks, block_size, num_kv_heads, head_dim) -> (seqlen, num_kv_heads, head_dim)
    block_size = cache.size(1)
    num_blocks = (seqlen + block_size - 1) // block_size
    blocks = block_table_row[:num_blocks].long()
    return cache[blocks].flatten(0, 1)[:seqlen]


def _attend(q, k, v, softmax_scale, causal):
    # q: (seqlen_q, nheads, d); k, v: (seqlen_k, nheads_k, d). flash-attn's causal mask is aligned
    # to the bottom-right corner of the (seqlen_q, seqlen_k) score matrix.
    seqlen_q, seqlen_k = q.size(0), k.size(0)
    group = q.size(1) // k.size(1)
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    mask = None
    if causal:
        mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(diagonal=seqlen_k - seqlen_q)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, scale=softmax_scale)
    return o.transpose(0, 1)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, block_table=None):
    out = torch.empty_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        q_start, q_end = cu_seqlens_q[i].item(), cu_seqlens_q[i + 1].item()
        k_start, k_end = cu_seqlens_k[i].item(), cu_seqlens_k[i + 1].item()
        seqlen_k = k_end - k_start
        assert q_end - q_start <= max_seqlen_q and seqlen_k <= max_seqlen_k
        if block_table is None:
            k_i, v_i = k[k_start:k_end], v[k_start:k_end]
        else:
            k_i = _gather_paged(k, block_table[i], seqlen_k)
            v_i = _gather_paged(v, block_table[i], seqlen_k)
        out[q_start:q_end] = _attend(q[q_start:q_end], k_i, v_i, softmax_scale, causal)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=False):
    # q: (batch, seqlen_q, nheads, d); paged k_cache / v_cache: (num_blocks, block_size, nheads_k, d)
    out = torch.empty_like(q)
    for i in range(q.size(0)):
        seqlen_k = cache_seqlens[i].item()
        k_i = _gather_paged(k_cache, block_table[i], seqlen_k)
        v_i = _gather_paged(v_cache, block_table[i], seqlen_k)
        out[i] = _attend(q[i], k_i, v_i, softmax_scale, causal)
    return out


# ---------------------------------------------------------------- nanovllm/layers/attention.py

def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    # The Triton kernel: one program per token, skipped where slot == -1.
    N, num_heads, head_dim = key.shape
    D = num_heads * head_dim
    assert k_cache.stride(1) == D and v_cache.stride(1) == D
    assert slot_mapping.numel() == N
    keep = slot_mapping != -1
    slots = slot_mapping[keep].long()
    k_cache.view(-1, D)[slots] = key[keep].reshape(-1, D)
    v_cache.view(-1, D)[slots] = value[keep].reshape(-1, D)


class Attention(nn.Module):

    def __init__(self, num_heads, head_dim, scale, num_kv_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        context = get_context()
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache.numel() and v_cache.numel():
            store_kvcache(k, v, k_cache, v_cache, context.slot_mapping)
        if context.is_prefill:
            if context.block_tables is not None:    # prefix cache
                k, v = k_cache, v_cache
            o = flash_attn_varlen_func(q, k, v,
                                       max_seqlen_q=context.max_seqlen_q, cu_seqlens_q=context.cu_seqlens_q,
                                       max_seqlen_k=context.max_seqlen_k, cu_seqlens_k=context.cu_seqlens_k,
                                       softmax_scale=self.scale, causal=True, block_table=context.block_tables)
        else:    # decode
            o = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                        cache_seqlens=context.context_lens, block_table=context.block_tables,
                                        softmax_scale=self.scale, causal=True)
        return o


# ---------------------------------------------------------------- nanovllm/layers/* (tp_size 1)

class LinearBase(nn.Module):

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor):
        param.data.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(LinearBase):

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int):
        shard_offset = sum(self.output_sizes[:loaded_shard_id])
        shard_size = self.output_sizes[loaded_shard_id]
        param.data.narrow(0, shard_offset, shard_size).copy_(loaded_weight)


class QKVParallelLinear(LinearBase):

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False):
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.num_heads = total_num_heads
        self.num_kv_heads = total_num_kv_heads
        super().__init__(hidden_size, (total_num_heads + 2 * total_num_kv_heads) * head_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str):
        assert loaded_shard_id in ["q", "k", "v"]
        if loaded_shard_id == "q":
            shard_size = self.num_heads * self.head_size
            shard_offset = 0
        elif loaded_shard_id == "k":
            shard_size = self.num_kv_heads * self.head_size
            shard_offset = self.num_heads * self.head_size
        else:
            shard_size = self.num_kv_heads * self.head_size
            shard_offset = self.num_heads * self.head_size + self.num_kv_heads * self.head_size
        param.data.narrow(0, shard_offset, shard_size).copy_(loaded_weight)


RowParallelLinear = LinearBase


class RMSNorm(nn.Module):

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def rms_forward(self, x):
        orig_dtype = x.dtype
        x = x.float()
        var = x.pow(2).mean(dim=-1, keepdim=True)
        x.mul_(torch.rsqrt(var + self.eps))
        return x.to(orig_dtype).mul_(self.weight)

    def add_rms_forward(self, x, residual):
        orig_dtype = x.dtype
        x = x.float().add_(residual.float())
        residual = x.to(orig_dtype)
        var = x.pow(2).mean(dim=-1, keepdim=True)
        x.mul_(torch.rsqrt(var + self.eps))
        return x.to(orig_dtype).mul_(self.weight), residual

    def forward(self, x, residual=None):
        if residual is None:
            return self.rms_forward(x)
        return self.add_rms_forward(x, residual)


class SiluAndMul(nn.Module):

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, y = x.chunk(2, -1)
        return F.silu(x) * y


def apply_rotary_emb(x, cos, sin):
    x1, x2 = torch.chunk(x.float(), 2, dim=-1)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    return torch.cat((y1, y2), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float) -> None:
        super().__init__()
        self.head_size = head_size
        assert rotary_dim == head_size
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).unsqueeze_(1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions, query, key):
        cos_sin = self.cos_sin_cache[positions]
        cos, sin = cos_sin.chunk(2, dim=-1)
        return apply_rotary_emb(query, cos, sin), apply_rotary_emb(key, cos, sin)


class VocabParallelEmbedding(nn.Module):

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, x: torch.Tensor):
        return F.embedding(x, self.weight)


class ParallelLMHead(VocabParallelEmbedding):

    def forward(self, x: torch.Tensor):
        context = get_context()
        if context.is_prefill:
            last_indices = context.cu_seqlens_q[1:] - 1
            x = x[last_indices].contiguous()
        return F.linear(x, self.weight)


class Sampler(nn.Module):

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor):
        logits = logits.float().div_(temperatures.unsqueeze(dim=1))
        probs = torch.softmax(logits, dim=-1)
        sample_tokens = probs.div_(torch.empty_like(probs).exponential_(1).clamp_min_(1e-10)).argmax(dim=-1)
        return sample_tokens


# ---------------------------------------------------------------- nanovllm/models/qwen3.py

class Qwen3Attention(nn.Module):

    def __init__(self, hidden_size, num_heads, num_kv_heads, max_position=4096 * 32, head_dim=None,
                 rms_norm_eps=1e-06, qkv_bias=False, rope_theta=10000, rope_scaling=None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        self.qkv_bias = qkv_bias
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden_size, bias=False)
        if isinstance(rope_scaling, dict):
            rope_theta = rope_scaling.get("rope_theta", rope_theta)
        self.rotary_emb = RotaryEmbedding(self.head_dim, self.head_dim, max_position, rope_theta)
        self.attn = Attention(self.num_heads, self.head_dim, self.scaling, self.num_kv_heads)
        if not self.qkv_bias:
            self.q_norm = RMSNorm(self.head_dim, eps=rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=rms_norm_eps)

    def forward(self, positions, hidden_states):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not self.qkv_bias:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o.flatten(1, -1))


class Qwen3MLP(nn.Module):

    def __init__(self, hidden_size, intermediate_size, hidden_act) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)
        assert hidden_act == "silu"
        self.act_fn = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            max_position=config.max_position_embeddings,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=getattr(config, "attention_bias", True),
            head_dim=getattr(config, "head_dim", None),
            rope_theta=getattr(config, "rope_theta", 1000000),
            rope_scaling=getattr(config, "rope_scaling", None),
        )
        self.mlp = Qwen3MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class Qwen3Model(nn.Module):

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions):
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.model = Qwen3Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight.data = self.model.embed_tokens.weight.data

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states):
        return self.lm_head(hidden_states)


# ---------------------------------------------------------------- nanovllm/utils/loader.py

def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor):
    param.data.copy_(loaded_weight)


def load_model(model: nn.Module, state_dict: dict[str, torch.Tensor]):
    # Upstream reads the checkpoint's *.safetensors; here the tensors come from a state dict.
    packed_modules_mapping = getattr(model, "packed_modules_mapping", {})
    for weight_name, tensor in state_dict.items():
        for k in packed_modules_mapping:
            if k in weight_name:
                v, shard_id = packed_modules_mapping[k]
                param = model.get_parameter(weight_name.replace(k, v))
                getattr(param, "weight_loader")(param, tensor, shard_id)
                break
        else:
            param = model.get_parameter(weight_name)
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)


# ---------------------------------------------------------------- nanovllm/engine/model_runner.py

class ModelRunner:

    def __init__(self, config: Config, state_dict):
        self.config = config
        hf_config = config.hf_config
        self.block_size = config.kvcache_block_size
        self.model = Qwen3ForCausalLM(hf_config)
        load_model(self.model, state_dict)
        self.sampler = Sampler()
        self.warmup_model()
        self.allocate_kv_cache()
        self.last_logits = None

    def warmup_model(self):
        max_num_batched_tokens, max_model_len = self.config.max_num_batched_tokens, self.config.max_model_len
        seq_len = min(max_num_batched_tokens, max_model_len)
        num_seqs = min(max_num_batched_tokens // seq_len, self.config.max_num_seqs)
        seqs = [Sequence([0] * seq_len) for _ in range(num_seqs)]
        for seq in seqs:
            seq.num_scheduled_tokens = seq_len
        self.run(seqs, True)

    def allocate_kv_cache(self):
        config = self.config
        hf_config = config.hf_config
        num_kv_heads = hf_config.num_key_value_heads
        head_dim = getattr(hf_config, "head_dim", hf_config.hidden_size // hf_config.num_attention_heads)
        assert config.num_kvcache_blocks > 0   # upstream sizes it from free GPU memory
        self.kv_cache = torch.empty(2, hf_config.num_hidden_layers, config.num_kvcache_blocks, self.block_size,
                                    num_kv_heads, head_dim)
        layer_id = 0
        for module in self.model.modules():
            if hasattr(module, "k_cache") and hasattr(module, "v_cache"):
                module.k_cache = self.kv_cache[0, layer_id]
                module.v_cache = self.kv_cache[1, layer_id]
                layer_id += 1

    def prepare_block_tables(self, seqs: list[Sequence]):
        max_len = max(len(seq.block_table) for seq in seqs)
        block_tables = [seq.block_table + [-1] * (max_len - len(seq.block_table)) for seq in seqs]
        return torch.tensor(block_tables, dtype=torch.int32)

    def prepare_prefill(self, seqs: list[Sequence]):
        input_ids = []
        positions = []
        cu_seqlens_q = [0]
        cu_seqlens_k = [0]
        max_seqlen_q = 0
        max_seqlen_k = 0
        slot_mapping = []
        block_tables = None
        for seq in seqs:
            start = seq.num_cached_tokens
            seqlen_q = seq.num_scheduled_tokens
            end = start + seqlen_q
            seqlen_k = end
            input_ids.extend(seq[start:end])
            positions.extend(range(start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + seqlen_q)
            cu_seqlens_k.append(cu_seqlens_k[-1] + seqlen_k)
            max_seqlen_q = max(seqlen_q, max_seqlen_q)
            max_seqlen_k = max(seqlen_k, max_seqlen_k)
            if not seq.block_table:    # warmup
                continue
            start_block = start // self.block_size
            end_block = (end + self.block_size - 1) // self.block_size
            for i in range(start_block, end_block):
                slot_start = seq.block_table[i] * self.block_size
                if i == start_block:
                    slot_start += start % self.block_size
                if i != end_block - 1:
                    slot_end = seq.block_table[i] * self.block_size + self.block_size
                else:
                    slot_end = seq.block_table[i] * self.block_size + end - i * self.block_size
                slot_mapping.extend(range(slot_start, slot_end))
        if cu_seqlens_k[-1] > cu_seqlens_q[-1]:    # prefix cache
            block_tables = self.prepare_block_tables(seqs)
        input_ids = torch.tensor(input_ids, dtype=torch.int64)
        positions = torch.tensor(positions, dtype=torch.int64)
        cu_seqlens_q = torch.tensor(cu_seqlens_q, dtype=torch.int32)
        cu_seqlens_k = torch.tensor(cu_seqlens_k, dtype=torch.int32)
        slot_mapping = torch.tensor(slot_mapping, dtype=torch.int32)
        set_context(True, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, slot_mapping, None, block_tables)
        return input_ids, positions

    def prepare_decode(self, seqs: list[Sequence]):
        input_ids = []
        positions = []
        slot_mapping = []
        context_lens = []
        for seq in seqs:
            input_ids.append(seq.last_token)
            positions.append(len(seq) - 1)
            context_lens.append(len(seq))
            slot_mapping.append(seq.block_table[-1] * self.block_size + seq.last_block_num_tokens - 1)
        input_ids = torch.tensor(input_ids, dtype=torch.int64)
        positions = torch.tensor(positions, dtype=torch.int64)
        slot_mapping = torch.tensor(slot_mapping, dtype=torch.int32)
        context_lens = torch.tensor(context_lens, dtype=torch.int32)
        block_tables = self.prepare_block_tables(seqs)
        set_context(False, slot_mapping=slot_mapping, context_lens=context_lens, block_tables=block_tables)
        return input_ids, positions

    def prepare_sample(self, seqs: list[Sequence]):
        return torch.tensor([seq.temperature for seq in seqs], dtype=torch.float32)

    @torch.inference_mode()
    def run_model(self, input_ids, positions, is_prefill):
        return self.model.compute_logits(self.model(input_ids, positions))

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        input_ids, positions = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        temperatures = self.prepare_sample(seqs)
        logits = self.run_model(input_ids, positions, is_prefill)
        self.last_logits = logits
        token_ids = self.sampler(logits, temperatures).tolist()
        reset_context()
        return token_ids


# ---------------------------------------------------------------- nanovllm/engine/llm_engine.py

class LLMEngine:

    def __init__(self, config: Config, state_dict):
        Sequence.block_size = config.kvcache_block_size
        self.model_runner = ModelRunner(config, state_dict)
        self.scheduler = Scheduler(config)
        self.seqs: dict[int, Sequence] = {}
        self.sampled_logits: dict[tuple[int, int], torch.Tensor] = {}

    def add_request(self, prompt: list[int], sampling_params: SamplingParams):
        seq = Sequence(prompt, sampling_params)
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)

    def step(self):
        seqs, is_prefill = self.scheduler.schedule()
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
        lens_before = [len(seq) for seq in seqs]
        token_ids = self.model_runner.run(seqs, is_prefill)
        logits = self.model_runner.last_logits
        self.scheduler.postprocess(seqs, token_ids, is_prefill)
        for i, (seq, n) in enumerate(zip(seqs, lens_before)):
            if len(seq) > n:    # a token was sampled from this row (the last chunk of a prefill, or a decode)
                self.sampled_logits[(seq.seq_id, n)] = logits[i]
        outputs = [(seq.seq_id, seq.completion_token_ids) for seq in seqs if seq.is_finished]
        return outputs, num_tokens

    def is_finished(self):
        return self.scheduler.is_finished()


# ---------------------------------------------------------------- run and check

def main():
    torch.manual_seed(0)
    hf_config = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="eager",
    )
    reference = HFQwen3ForCausalLM(hf_config).to(torch.float64).eval()
    with torch.no_grad():
        for p in reference.parameters():   # q_norm / k_norm / layer norms start at ones; make them count
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))

    config = Config(hf_config, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64,
                    kvcache_block_size=4, num_kvcache_blocks=20)
    engine = LLMEngine(config, reference.state_dict())

    g = torch.Generator().manual_seed(1)
    system = torch.randint(1, 128, (10,), generator=g).tolist()
    first_wave = [system + torch.randint(1, 128, (n,), generator=g).tolist() for n in (3, 20, 1)]
    second_wave = [system + torch.randint(1, 128, (n,), generator=g).tolist() for n in (8, 2, 11)]
    second_wave.append(first_wave[1][:19])    # shares more than the system prompt with a first-wave request
    max_tokens = [9, 6, 12, 7, 10, 5, 8]

    for prompt, m in zip(first_wave, max_tokens):
        engine.add_request(prompt, SamplingParams(temperature=0.8, max_tokens=m, ignore_eos=True))
    steps = 0
    outputs = {}
    while not engine.is_finished():
        output, _ = engine.step()
        outputs.update(output)
        steps += 1
        if steps == 4:
            for prompt, m in zip(second_wave, max_tokens[len(first_wave):]):
                engine.add_request(prompt, SamplingParams(temperature=0.8, max_tokens=m, ignore_eos=True))
        assert steps < 500
    assert len(outputs) == len(engine.seqs)

    scheduler = engine.scheduler
    print(f"steps={steps} preemptions={scheduler.num_preemptions} "
          f"chunked_prefills={scheduler.num_chunked_prefills} "
          f"prefix_cache_blocks_hit={scheduler.block_manager.num_prefix_hits}")
    assert scheduler.num_preemptions > 0 and scheduler.num_chunked_prefills > 0
    assert scheduler.block_manager.num_prefix_hits > 0

    # Reference: each finished sequence alone, whole, no cache, transformers' own causal mask.
    worst = 0.0
    with torch.no_grad():
        for seq_id, seq in engine.seqs.items():
            assert seq.num_completion_tokens == seq.max_tokens
            ref_logits = reference(torch.tensor([seq.token_ids])).logits[0]
            for n in range(seq.num_prompt_tokens, seq.num_tokens):
                got = engine.sampled_logits[(seq_id, n)]
                worst = max(worst, (got - ref_logits[n - 1]).abs().max().item())
    print(f"max |engine logits - reference logits| = {worst:.3e}")
    assert worst < 1e-5, worst   # RMSNorm and rotary run in float32 as upstream
    print("ok")


if __name__ == "__main__":
    main()
