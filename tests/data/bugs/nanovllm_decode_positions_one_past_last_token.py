"""nano-vllm decode step: the new token's RoPE position is one past where it sits.

Citation: GeeeekExplorer/nano-vllm#67 (commit f5b4840, "fix(model_runner): correct
position indexing to be 0-based"), nanovllm/engine/model_runner.py ModelRunner.prepare_decode.

Bug: when the scheduler hands a running sequence to a decode step its last sampled token
has already been appended (Scheduler.postprocess -> Sequence.append_token), so that token
sits at index len(seq) - 1 -- which is where slot_mapping writes its K/V and what
context_lens counts.  prepare_decode gave it positions.append(len(seq)), so the decode
query and the key written to the paged cache were rotated one position too far, while
every prompt key was rotated at its true position.
Fix: positions.append(len(seq) - 1).

Trimmed to CPU: the Triton store_kvcache kernel and flash-attn's flash_attn_varlen_func /
flash_attn_with_kvcache are replaced by plain-torch stand-ins with the same arguments
(cu_seqlens, slot_mapping, block_table, cache_seqlens); single process, no tensor
parallelism, no CUDA graphs, no prefix caching.  The model is nano-vllm's Qwen3 built
from a tiny transformers Qwen3Config with random weights.
"""
import sys
from collections import deque
from copy import copy
from dataclasses import dataclass
from itertools import count

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- utils/context.py
@dataclass
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

def set_context(is_prefill, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, slot_mapping=None, context_lens=None, block_tables=None):
    global _CONTEXT
    _CONTEXT = Context(is_prefill, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, slot_mapping, context_lens, block_tables)

def reset_context():
    global _CONTEXT
    _CONTEXT = Context()


# ---------------------------------------------------------------- engine/sequence.py
class Sequence:
    block_size = 4
    counter = count()

    def __init__(self, token_ids: list[int], max_tokens: int):
        self.seq_id = next(Sequence.counter)
        self.finished = False
        self.token_ids = copy(token_ids)
        self.last_token = token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0
        self.block_table = []
        self.temperature = 0.0
        self.max_tokens = max_tokens

    def __len__(self):
        return self.num_tokens

    def __getitem__(self, key):
        return self.token_ids[key]

    @property
    def num_completion_tokens(self):
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self):
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_cached_blocks(self):
        return self.num_cached_tokens // self.block_size

    @property
    def num_blocks(self):
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self):
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


# ---------------------------------------------------------------- engine/block_manager.py (no prefix hashing)
class BlockManager:

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    def allocate(self, seq: Sequence):
        assert not seq.block_table
        for _ in range(seq.num_blocks):
            seq.block_table.append(self.free_block_ids.popleft())

    def deallocate(self, seq: Sequence):
        for block_id in reversed(seq.block_table):
            self.free_block_ids.append(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def may_append(self, seq: Sequence):
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self.free_block_ids.popleft())


# ---------------------------------------------------------------- engine/scheduler.py (trimmed)
class Scheduler:

    def __init__(self, num_blocks, block_size):
        self.block_manager = BlockManager(num_blocks, block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def is_finished(self):
        return not self.waiting and not self.running

    def add(self, seq):
        self.waiting.append(seq)

    def schedule(self):
        scheduled_seqs = []
        while self.waiting:
            seq = self.waiting.popleft()
            self.block_manager.allocate(seq)
            self.running.append(seq)
            scheduled_seqs.append(seq)
        if scheduled_seqs:
            return scheduled_seqs, True
        while self.running:
            seq = self.running.popleft()
            self.block_manager.may_append(seq)
            scheduled_seqs.append(seq)
        self.running.extendleft(reversed(scheduled_seqs))
        return scheduled_seqs, False

    def postprocess(self, seqs, token_ids):
        for seq, token_id in zip(seqs, token_ids):
            seq.append_token(token_id)
            if seq.num_completion_tokens == seq.max_tokens:
                seq.finished = True
                self.block_manager.deallocate(seq)
                self.running.remove(seq)


# ---------------------------------------------------------------- kernel stand-ins (flash-attn / triton on CPU)
def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    N, num_heads, head_dim = key.shape
    D = num_heads * head_dim
    k_cache.view(-1, D)[slot_mapping.long()] = key.reshape(N, D)
    v_cache.view(-1, D)[slot_mapping.long()] = value.reshape(N, D)


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, softmax_scale, causal, block_table=None):
    outs = []
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi = q[qs:qe].transpose(0, 1)
        ki = k[ks:ke].transpose(0, 1).repeat_interleave(q.size(1) // k.size(1), 0)
        vi = v[ks:ke].transpose(0, 1).repeat_interleave(q.size(1) // v.size(1), 0)
        s = (qi @ ki.transpose(-1, -2)) * softmax_scale
        if causal:  # bottom-right aligned, as flash-attn
            Lq, Lk = qe - qs, ke - ks
            keep = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)
            s = s.masked_fill(~keep, float("-inf"))
        outs.append((s.softmax(-1) @ vi).transpose(0, 1))
    return torch.cat(outs, 0)


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal):
    bs, _, nh, hd = q.shape
    block_size = k_cache.size(1)
    outs = []
    for b in range(bs):
        L = int(cache_seqlens[b])
        blocks = [int(x) for x in block_table[b] if int(x) >= 0]
        k = k_cache[blocks].reshape(-1, k_cache.size(2), hd)[:L]
        v = v_cache[blocks].reshape(-1, v_cache.size(2), hd)[:L]
        k = k.transpose(0, 1).repeat_interleave(nh // k_cache.size(2), 0)
        v = v.transpose(0, 1).repeat_interleave(nh // v_cache.size(2), 0)
        qb = q[b].transpose(0, 1)  # (nh, 1, hd)
        s = (qb @ k.transpose(-1, -2)) * softmax_scale
        outs.append((s.softmax(-1) @ v).transpose(0, 1))
    return torch.stack(outs, 0)


# ---------------------------------------------------------------- layers
class Attention(nn.Module):

    def __init__(self, num_heads, head_dim, scale, num_kv_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q, k, v):
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        context = get_context()
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache.numel() and v_cache.numel():
            store_kvcache(k, v, k_cache, v_cache, context.slot_mapping)
        if context.is_prefill:
            o = flash_attn_varlen_func(q, k, v,
                                       max_seqlen_q=context.max_seqlen_q, cu_seqlens_q=context.cu_seqlens_q,
                                       max_seqlen_k=context.max_seqlen_k, cu_seqlens_k=context.cu_seqlens_k,
                                       softmax_scale=self.scale, causal=True, block_table=context.block_tables)
        else:    # decode
            o = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                        cache_seqlens=context.context_lens, block_table=context.block_tables,
                                        softmax_scale=self.scale, causal=True)
        return o.reshape(-1, self.num_heads * self.head_dim)


def apply_rotary_emb(x, cos, sin):
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    x1, x2 = torch.chunk(x.to(torch.float32), 2, dim=-1)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    return torch.cat((y1, y2), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):

    def __init__(self, head_size, rotary_dim, max_position_embeddings, base):
        super().__init__()
        self.head_size = head_size
        inv_freq = 1.0 / (base**(torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        t = torch.arange(max_position_embeddings, dtype=torch.float)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions, query, key):
        num_tokens = positions.size(0)
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        query_shape, key_shape = query.shape, key.shape
        query = apply_rotary_emb(query.view(num_tokens, -1, self.head_size), cos, sin).view(query_shape)
        key = apply_rotary_emb(key.view(num_tokens, -1, self.head_size), cos, sin).view(key_shape)
        return query, key


class RMSNorm(nn.Module):

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def rms_forward(self, x):
        var = x.float().pow(2).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight

    def forward(self, x, residual=None):
        if residual is None:
            return self.rms_forward(x)
        x = x + residual
        return self.rms_forward(x), x


class Qwen3Attention(nn.Module):

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, self.head_dim, config.max_position_embeddings,
                                          getattr(config, "rope_theta", 1000000))
        self.attn = Attention(self.num_heads, self.head_dim, self.scaling, self.num_kv_heads)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim)).view(q.shape)
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Qwen3DecoderLayer(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.self_attn = Qwen3Attention(config)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        x, y = self.gate_up_proj(hidden_states).chunk(2, -1)
        hidden_states = self.down_proj(F.silu(x) * y)
        return hidden_states, residual


class Qwen3ForCausalLM(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions):
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def compute_logits(self, hidden_states):
        context = get_context()
        if context.is_prefill:  # ParallelLMHead: last token of each sequence
            last_indices = context.cu_seqlens_q[1:] - 1
            hidden_states = hidden_states[last_indices].contiguous()
        return self.lm_head(hidden_states)


# ---------------------------------------------------------------- engine/model_runner.py
class ModelRunner:

    def __init__(self, config: Qwen3Config, block_size: int, num_kvcache_blocks: int):
        self.block_size = block_size
        self.model = Qwen3ForCausalLM(config)
        self.kv_cache = torch.zeros(2, config.num_hidden_layers, num_kvcache_blocks, block_size,
                                    config.num_key_value_heads, config.head_dim)
        layer_id = 0
        for module in self.model.modules():
            if hasattr(module, "k_cache") and hasattr(module, "v_cache"):
                module.k_cache = self.kv_cache[0, layer_id]
                module.v_cache = self.kv_cache[1, layer_id]
                layer_id += 1

    def prepare_block_tables(self, seqs):
        max_len = max(len(seq.block_table) for seq in seqs)
        block_tables = [seq.block_table + [-1] * (max_len - len(seq.block_table)) for seq in seqs]
        return torch.tensor(block_tables, dtype=torch.int32)

    def prepare_prefill(self, seqs):
        input_ids = []
        positions = []
        cu_seqlens_q = [0]
        cu_seqlens_k = [0]
        max_seqlen_q = 0
        max_seqlen_k = 0
        slot_mapping = []
        block_tables = None
        for seq in seqs:
            seqlen = len(seq)
            input_ids.extend(seq[seq.num_cached_tokens:])
            positions.extend(list(range(seq.num_cached_tokens, seqlen)))
            seqlen_q = seqlen - seq.num_cached_tokens
            seqlen_k = seqlen
            cu_seqlens_q.append(cu_seqlens_q[-1] + seqlen_q)
            cu_seqlens_k.append(cu_seqlens_k[-1] + seqlen_k)
            max_seqlen_q = max(seqlen_q, max_seqlen_q)
            max_seqlen_k = max(seqlen_k, max_seqlen_k)
            if not seq.block_table:
                continue
            for i in range(seq.num_cached_blocks, seq.num_blocks):
                start = seq.block_table[i] * self.block_size
                if i != seq.num_blocks - 1:
                    end = start + self.block_size
                else:
                    end = start + seq.last_block_num_tokens
                slot_mapping.extend(list(range(start, end)))
        input_ids = torch.tensor(input_ids, dtype=torch.int64)
        positions = torch.tensor(positions, dtype=torch.int64)
        cu_seqlens_q = torch.tensor(cu_seqlens_q, dtype=torch.int32)
        cu_seqlens_k = torch.tensor(cu_seqlens_k, dtype=torch.int32)
        slot_mapping = torch.tensor(slot_mapping, dtype=torch.int32)
        set_context(True, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, slot_mapping, None, block_tables)
        return input_ids, positions

    def prepare_decode(self, seqs):
        input_ids = []
        positions = []
        slot_mapping = []
        context_lens = []
        for seq in seqs:
            input_ids.append(seq.last_token)
            if FIXED:
                positions.append(len(seq) - 1)
            else:
                positions.append(len(seq))
            context_lens.append(len(seq))
            slot_mapping.append(seq.block_table[-1] * self.block_size + seq.last_block_num_tokens - 1)
        input_ids = torch.tensor(input_ids, dtype=torch.int64)
        positions = torch.tensor(positions, dtype=torch.int64)
        slot_mapping = torch.tensor(slot_mapping, dtype=torch.int32)
        context_lens = torch.tensor(context_lens, dtype=torch.int32)
        block_tables = self.prepare_block_tables(seqs)
        set_context(False, slot_mapping=slot_mapping, context_lens=context_lens, block_tables=block_tables)
        return input_ids, positions

    @torch.inference_mode()
    def run(self, seqs, is_prefill):
        input_ids, positions = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        logits = self.model.compute_logits(self.model(input_ids, positions))
        token_ids = logits.argmax(dim=-1).tolist()  # Sampler with temperature 0: greedy
        reset_context()
        return token_ids


# ---------------------------------------------------------------- engine/llm_engine.py (generate loop)
def generate(runner, scheduler, prompts, max_tokens):
    seqs = [Sequence(p, max_tokens) for p in prompts]
    for seq in seqs:
        scheduler.add(seq)
    while not scheduler.is_finished():
        batch, is_prefill = scheduler.schedule()
        token_ids = runner.run(batch, is_prefill)
        scheduler.postprocess(batch, token_ids)
    return [seq.completion_token_ids for seq in seqs]


def main():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=128, rms_norm_eps=1e-6)
    block_size = 4
    Sequence.block_size = block_size
    runner = ModelRunner(config, block_size=block_size, num_kvcache_blocks=32)
    with torch.no_grad():
        for p in runner.model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.35)
    scheduler = Scheduler(num_blocks=32, block_size=block_size)
    prompts = [[3, 17, 42, 8, 25, 9, 33], [50, 2, 11, 60, 7]]
    outs = generate(runner, scheduler, prompts, max_tokens=12)
    for p, o in zip(prompts, outs):
        print("prompt", p, "->", o)


if __name__ == "__main__":
    main()
