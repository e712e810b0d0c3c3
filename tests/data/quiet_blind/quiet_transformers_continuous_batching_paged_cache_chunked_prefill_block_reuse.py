# Correct program (quiet batch quiet-r68a).
#
# Ported from huggingface/transformers v4.56.0 (wheel transformers-4.56.0, read for this port):
#   src/transformers/generation/continuous_batching/continuous_api.py
#     (PagedAttentionArgs, ContinuousBatchProcessor.setup_static_tensors / reset_static_tensors /
#      get_model_kwargs / prepare_next_batch / _build_tensors / update_batch,
#      ContinuousBatchingManager._generation_step / _model_forward / _sample)
#   src/transformers/generation/continuous_batching/cache.py
#     (PagedAttentionCache.allocate_blocks / free_blocks / _get_physical_indices / update)
#   src/transformers/generation/continuous_batching/scheduler.py (FIFOScheduler)
#   src/transformers/generation/continuous_batching/classes.py (RequestState, RequestStatus)
#   src/transformers/integrations/sdpa_paged.py (sdpa_attention_paged_forward)
#
# Continuous batching: every step packs the scheduled requests into one row (1, T) of query tokens.
# Each request's keys are read back from its own paged blocks (read_index), laid out one request after
# another (cumulative_seqlens_k), and `_build_tensors` fills a (1, 1, T, C) float mask, min-value
# everywhere except each request's own block, lower-right causal inside it. Requests arrive while others
# decode, prompts longer than the token budget are prefilled in chunks (PREFILLING_SPLIT), finished
# requests free their blocks and later requests reuse them (stale KV in a reused block is never read).
#
# The model is v4.56's LlamaForCausalLM, trimmed (tiny LlamaConfig, random weights), whose attention
# dispatches on config._attn_implementation = "sdpa_paged" and hands the paged kwargs (cache, read_index,
# write_index, cu_seq_lens_*) to the attention function. Self-check: every request is rerun alone, its
# whole sequence (prompt + generated tokens) in one forward with plain causal SDPA (is_causal=True), no
# padding, no mask tensor, no cache; the logits the batched engine sampled from at every step and the
# generated tokens must match.
import copy
import queue
import sys
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Optional

import torch
from torch import nn
from transformers import LlamaConfig

torch.manual_seed(0)


# ----------------------------------------------------------------------------------------------
# classes.py
class RequestStatus(Enum):
    PENDING = "pending"
    PREFILLING = "prefilling"
    PREFILLING_SPLIT = "prefilling_split"
    SPLIT_PENDING_REMAINDER = "split_pending_remainder"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class RequestState:
    request_id: str
    full_prompt_ids: Optional[list] = None
    prompt_ids: Optional[list] = None
    remaining_prompt_ids: list = field(default_factory=list)
    static_outputs: list = field(default_factory=list)
    allocated_blocks: list = field(default_factory=list)
    position_offset: int = 0
    status: RequestStatus = RequestStatus.PENDING
    max_new_tokens: int = 20
    eos_token_id: int = -1

    def current_len(self) -> int:
        return self.position_offset

    def generated_len(self) -> int:
        return len(self.static_outputs)

    def update_with_token(self, token_id: int) -> bool:
        if self.status != RequestStatus.DECODING:
            return False
        is_eos = token_id == self.eos_token_id and self.eos_token_id != -1
        is_max_len = self.generated_len() >= self.max_new_tokens
        if not (is_max_len and not is_eos):
            self.static_outputs.extend([token_id])
        if is_eos or is_max_len:
            self.status = RequestStatus.FINISHED
            return True
        return False


# ----------------------------------------------------------------------------------------------
# cache.py
class PagedAttentionCache:
    def __init__(self, config, block_size, num_blocks, max_batch_tokens, device, dtype):
        self.dtype = dtype
        self.device = device
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_hidden_layers = config.num_hidden_layers
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_batch_tokens = max_batch_tokens
        self.cache_shape = (self.num_key_value_heads, num_blocks, self.block_size, self.head_dim)
        self.key_cache = []
        self.value_cache = []
        for _ in range(config.num_hidden_layers):
            # filled with noise, not zeros: a slot that is read without being written would show
            self.key_cache.append(torch.randn(self.cache_shape, dtype=self.dtype, device=device) * 5)
            self.value_cache.append(torch.randn(self.cache_shape, dtype=self.dtype, device=device) * 5)
        self._free_blocks = deque(range(num_blocks))
        self._block_tables = {}

    def allocate_blocks(self, n_blocks: int, request_id: str):
        if len(self._free_blocks) < n_blocks:
            return False
        allocated = []
        for _ in range(n_blocks):
            allocated.append(self._free_blocks.popleft())
        if request_id not in self._block_tables:
            self._block_tables[request_id] = []
        self._block_tables[request_id].extend(allocated)
        return allocated

    def free_blocks(self, request_id: str) -> None:
        if request_id in self._block_tables:
            blocks_to_free = self._block_tables.pop(request_id)
            self._free_blocks.extend(blocks_to_free)

    def get_num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def _get_physical_indices(self, state: RequestState, logical_indices: list) -> list:
        request_id = state.request_id
        block_table = self._block_tables.get(request_id)
        if not block_table:
            raise ValueError(f"No block table found for request {request_id}")
        block_size = self.block_size
        physical_indices = []
        for idx in logical_indices:
            block_idx = idx // block_size
            block_offset = idx % block_size
            if block_idx >= len(block_table):
                raise IndexError(f"Logical index {idx} maps to block index {block_idx} out of bounds")
            physical_block_num = block_table[block_idx]
            physical_index = physical_block_num * block_size + block_offset
            physical_indices.append(physical_index)
        return physical_indices

    def update(self, key_states, value_states, layer_idx, read_index, write_index, **kwargs):
        total_slots = self.num_blocks * self.block_size
        k_cache_flat = self.key_cache[layer_idx].view(self.num_key_value_heads, total_slots, self.head_dim)
        v_cache_flat = self.value_cache[layer_idx].view(self.num_key_value_heads, total_slots, self.head_dim)
        k_cache_flat[:, write_index, :] = key_states[0]
        v_cache_flat[:, write_index, :] = value_states[0]
        return k_cache_flat[None, :, read_index, :], v_cache_flat[None, :, read_index, :]


# ----------------------------------------------------------------------------------------------
# integrations/sdpa_paged.py
def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def sdpa_attention_paged_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                 is_causal=None, **kwargs):
    cache = kwargs.pop("cache", None)
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, **kwargs)
    if hasattr(module, "num_key_value_groups"):
        key = repeat_kv(key, module.num_key_value_groups)
        value = repeat_kv(value, module.num_key_value_groups)
    causal_mask = attention_mask
    query = query.contiguous()
    key = key.contiguous()
    value = value.contiguous()
    attn_output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=causal_mask, dropout_p=dropout, scale=scaling, is_causal=False,
    )
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, None


ALL_ATTENTION_FUNCTIONS = {"sdpa_paged": sdpa_attention_paged_forward}


# ----------------------------------------------------------------------------------------------
# models/llama/modeling_llama.py (v4.56.0), trimmed: the decoder the paged kwargs flow through.
class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        base = 10000.0
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask, dropout=0.0, scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, position_embeddings=position_embeddings,
                                          attention_mask=attention_mask, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


@dataclass
class CausalLMOutput:
    logits: torch.Tensor


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **kwargs):
        hidden_states = self.embed_tokens(input_ids)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=attention_mask,
                                          position_embeddings=position_embeddings, **kwargs)
        hidden_states = self.norm(hidden_states)
        return CausalLMOutput(logits=self.lm_head(hidden_states))


# ----------------------------------------------------------------------------------------------
# scheduler.py
class FIFOScheduler:
    def __init__(self, cache: PagedAttentionCache, safety_margin: float = 0.0):
        self.active_requests = {}
        self.waiting_requests = {}
        self.waiting_requests_order = deque()
        self.cache = cache
        self.safety_margin = safety_margin

    def has_pending_requests(self) -> bool:
        return len(self.active_requests) or len(self.waiting_requests)

    def _allocate_blocks_if_needed(self, state: RequestState, len_next_tokens: int):
        current_len = state.current_len()
        occupancy = len(state.allocated_blocks) * self.cache.block_size - current_len
        if occupancy < len_next_tokens or (len(state.allocated_blocks) == 0):
            blocks_needed = ((len_next_tokens - occupancy + 1) // self.cache.block_size) + 1
            allocated = self.cache.allocate_blocks(blocks_needed, state.request_id)
            if not allocated:
                return False
            state.allocated_blocks.extend(allocated)
        return True

    def _prepare_request_for_processing(self, state, token_budget, request_ids_to_remove_from_waiting):
        request_tokens = (
            state.remaining_prompt_ids if state.status == RequestStatus.SPLIT_PENDING_REMAINDER else state.prompt_ids
        )
        if len(request_tokens) < token_budget:
            if state.status == RequestStatus.PENDING:
                self.active_requests[state.request_id] = state
                state.status = RequestStatus.PREFILLING
                request_ids_to_remove_from_waiting.add(state.request_id)
            elif state.status == RequestStatus.SPLIT_PENDING_REMAINDER:
                state.status = RequestStatus.PREFILLING
                state.prompt_ids = state.remaining_prompt_ids
                state.remaining_prompt_ids = []
        else:
            if state.status == RequestStatus.PENDING:
                self.active_requests[state.request_id] = state
                state.status = RequestStatus.PREFILLING_SPLIT
                request_ids_to_remove_from_waiting.add(state.request_id)
            elif state.status == RequestStatus.SPLIT_PENDING_REMAINDER:
                state.status = RequestStatus.PREFILLING_SPLIT
            state.remaining_prompt_ids = request_tokens[token_budget:]
            state.prompt_ids = request_tokens[:token_budget]

    def add_waiting_request(self, state: RequestState):
        self.waiting_requests[state.request_id] = state
        self.waiting_requests_order.append(state.request_id)

    def schedule_batch(self, token_budget: int) -> list:
        priority_states = []
        second_priority_states = []
        scheduled_requests = []
        for state in self.active_requests.values():
            if state.status == RequestStatus.DECODING:
                priority_states.append(state)
            if state.status == RequestStatus.SPLIT_PENDING_REMAINDER:
                second_priority_states.append(state)
        for req_id in self.waiting_requests_order:
            second_priority_states.append(self.waiting_requests[req_id])

        candidates = priority_states + second_priority_states
        request_ids_to_remove_from_waiting = set()
        safety_margins = self.safety_margin * self.cache.num_blocks

        for state in candidates:
            num_free_blocks = self.cache.get_num_free_blocks()
            outside_safety_margin = num_free_blocks < safety_margins
            if outside_safety_margin and scheduled_requests and state.status != RequestStatus.DECODING:
                break
            self._prepare_request_for_processing(state, token_budget, request_ids_to_remove_from_waiting)
            request_len = len(state.prompt_ids)
            if not self._allocate_blocks_if_needed(state, len(state.prompt_ids)):
                if len(self.cache._free_blocks) == 0:
                    break
                continue
            scheduled_requests.append(state)
            token_budget -= request_len
            req_id = state.request_id
            if req_id in self.waiting_requests:
                del self.waiting_requests[req_id]
                request_ids_to_remove_from_waiting.add(req_id)
            if token_budget == 0:
                break

        self.waiting_requests_order = deque(
            [req_id for req_id in self.waiting_requests_order if req_id not in request_ids_to_remove_from_waiting]
        )
        return scheduled_requests

    def finish_request(self, request_id: str, evict_from_cache: bool = True):
        if evict_from_cache:
            self.cache.free_blocks(request_id)
            if request_id in self.active_requests:
                del self.active_requests[request_id]


# ----------------------------------------------------------------------------------------------
# continuous_api.py
class ContinuousBatchProcessor:
    def __init__(self, cache, config, input_queue, output_queue, model_device, model_dtype, scheduler,
                 slice_inputs=True):
        self.cache = cache
        self.config = config
        self.input_queue = input_queue
        self.output_queue = output_queue
        self.model_device = model_device
        self.model_dtype = model_dtype
        self.scheduler = scheduler
        self.slice_inputs = slice_inputs
        self.requests_in_batch = []
        self.max_batch_tokens = cache.max_batch_tokens
        self.setup_static_tensors()

    def return_attention_mask(self) -> bool:
        return self.config._attn_implementation != "paged_attention"

    def setup_static_tensors(self):
        T = self.max_batch_tokens
        max_token_budget = self.cache.num_blocks * self.cache.block_size
        tensor_metadata = {"dtype": torch.int32, "device": self.model_device}
        self.tensor_metadata = tensor_metadata
        self.input_ids = torch.empty((1, T), **tensor_metadata)
        self.position_ids = torch.empty((1, T), **tensor_metadata)
        self.cumulative_seqlens_q = torch.empty((T + 1,), **tensor_metadata)
        self.cumulative_seqlens_k = torch.empty((T + 1,), **tensor_metadata)
        self.write_index = torch.empty((T,), **tensor_metadata)
        self.read_index = torch.empty((max_token_budget,), **tensor_metadata)
        self.logits_indices = torch.empty((T,), **tensor_metadata)
        self.max_seqlen_q = 0
        self.max_seqlen_k = 0
        self.output_ids = torch.empty((1, T), **tensor_metadata)
        if self.return_attention_mask():
            self.attention_mask = torch.empty(
                (1, 1, T, max_token_budget), dtype=self.model_dtype, device=self.model_device
            )
        else:
            self.attention_mask = None
        self.actual_tokens = T
        self.cache_used = max_token_budget
        self.reset_static_tensors()
        self.actual_tokens = 0
        self.cache_used = 0

    @torch.no_grad()
    def reset_static_tensors(self):
        t = self.actual_tokens if self.slice_inputs else self.write_index.size(0)
        c = self.cache_used if self.slice_inputs else self.read_index.size(0)
        self.input_ids[:, :t].zero_()
        self.position_ids[:, :t].zero_()
        self.cumulative_seqlens_q[: t + 1].zero_()
        self.cumulative_seqlens_k[: t + 1].zero_()
        self.write_index[:t].fill_(-1)
        self.read_index[:c].fill_(-1)
        self.logits_indices[:t].fill_(-1)
        self.max_seqlen_q = 0
        self.max_seqlen_k = 0
        self.output_ids[:, :t].fill_(-1)
        if self.attention_mask is not None:
            self.attention_mask[:, :, :t, :c].fill_(torch.finfo(self.model_dtype).min)

    def get_model_kwargs(self):
        t = self.actual_tokens if self.slice_inputs else self.write_index.size(0)
        c = self.cache_used if self.slice_inputs else self.read_index.size(0)
        kwargs = {
            "input_ids": self.input_ids[:, :t],
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids[:, :t],
            "cu_seq_lens_q": self.cumulative_seqlens_q[: t + 1],
            "cu_seq_lens_k": self.cumulative_seqlens_k[: t + 1],
            "write_index": self.write_index[:t],
            "read_index": self.read_index[:c],
            "logits_indices": self.logits_indices[:t],
            "max_seqlen_q": self.max_seqlen_q,
            "max_seqlen_k": self.max_seqlen_k,
            "block_tables": self.cache._block_tables,
            "cache": self.cache,
            "use_cache": False,
        }
        if self.attention_mask is not None:
            kwargs["attention_mask"] = self.attention_mask[:, :, :t, :c]
        return kwargs

    def _get_new_requests(self):
        while not self.input_queue.empty():
            state = self.input_queue.get_nowait()
            if state is None:
                continue
            self.scheduler.add_waiting_request(state)

    def prepare_next_batch(self):
        self._get_new_requests()
        if not self.scheduler.has_pending_requests():
            return None
        self.requests_in_batch = self.scheduler.schedule_batch(self.max_batch_tokens)
        if not self.requests_in_batch:
            return None

        self.reset_static_tensors()
        position_ids = []
        input_ids = []
        read_index = []
        write_index = []
        cumulative_seqlens_q = [0]
        cumulative_seqlens_k = [0]
        logits_indices = []

        for state in self.requests_in_batch:
            next_input_ids = state.prompt_ids
            input_ids.extend(next_input_ids)
            past_length = state.position_offset
            query_length = len(next_input_ids)
            key_length = query_length + past_length
            cache_index = list(range(key_length))

            positions_to_add = cache_index[past_length:]
            read_indices = self.cache._get_physical_indices(state, cache_index)
            write_indices = read_indices[-query_length:]

            position_ids.extend(positions_to_add)
            read_index.extend(read_indices)
            write_index.extend(write_indices)
            cumulative_seqlens_q.append(cumulative_seqlens_q[-1] + query_length)
            cumulative_seqlens_k.append(cumulative_seqlens_k[-1] + key_length)
            if len(state.remaining_prompt_ids) == 0:
                logits_indices.append(cumulative_seqlens_q[-1] - 1)
            self.max_seqlen_q = max(self.max_seqlen_q, query_length)
            self.max_seqlen_k = max(self.max_seqlen_k, key_length)
            state.position_offset += query_length

        self._build_tensors(input_ids, position_ids, read_index, write_index, cumulative_seqlens_q,
                            cumulative_seqlens_k, logits_indices)

    def _build_tensors(self, input_ids, position_ids, read_index, write_index, cumulative_seqlens_q,
                       cumulative_seqlens_k, logits_indices):
        to_tensor = partial(torch.tensor, **self.tensor_metadata)
        self.input_ids[:, : len(input_ids)] = to_tensor(input_ids)
        self.position_ids[:, : len(position_ids)] = to_tensor(position_ids)
        self.write_index[: len(write_index)] = to_tensor(write_index)
        self.read_index[: len(read_index)] = to_tensor(read_index)
        self.cumulative_seqlens_q[: len(cumulative_seqlens_q)] = to_tensor(cumulative_seqlens_q)
        self.cumulative_seqlens_k[: len(cumulative_seqlens_k)] = to_tensor(cumulative_seqlens_k)
        self.logits_indices[: len(logits_indices)] = to_tensor(logits_indices)

        self.actual_tokens = len(input_ids)
        self.cache_used = len(read_index)

        min_value = torch.finfo(self.model_dtype).min
        if self.attention_mask is not None:
            for i in range(len(cumulative_seqlens_q) - 1):
                if (
                    cumulative_seqlens_q[i + 1] - cumulative_seqlens_q[i]
                    < cumulative_seqlens_k[i + 1] - cumulative_seqlens_k[i]
                    and cumulative_seqlens_q[i + 1] - cumulative_seqlens_q[i] >= 1
                ):
                    diagonal = (
                        cumulative_seqlens_k[i + 1] - (cumulative_seqlens_q[i + 1] - cumulative_seqlens_q[i]) + 1
                    )
                    diagonal = diagonal - cumulative_seqlens_k[i]
                else:
                    diagonal = 1
                query_range = slice(cumulative_seqlens_q[i], cumulative_seqlens_q[i + 1])
                key_range = slice(cumulative_seqlens_k[i], cumulative_seqlens_k[i + 1])
                mask = torch.triu(
                    torch.full(
                        self.attention_mask[..., query_range, key_range].shape,
                        min_value,
                        dtype=self.model_dtype,
                        device=self.model_device,
                    ),
                    diagonal=diagonal,
                )
                self.attention_mask[..., query_range, key_range] = mask

    def _sync(self):
        return self.output_ids.tolist()[0]

    def update_batch(self):
        out_tokens = self._sync()
        for i, state in enumerate(self.requests_in_batch):
            if len(state.remaining_prompt_ids) == 0:
                state.status = RequestStatus.DECODING
                token = out_tokens[self.logits_indices[i]]
                state.prompt_ids = [token]
                if state.update_with_token(token):
                    self.scheduler.finish_request(state.request_id, evict_from_cache=True)
                    self.output_queue.put(state)
            elif state.status == RequestStatus.PREFILLING_SPLIT:
                state.status = RequestStatus.SPLIT_PENDING_REMAINDER


# ----------------------------------------------------------------------------------------------
# The manager's generation step, greedy (do_sample=False).
def generation_step(model, batch_processor, step_log):
    batch_data = batch_processor.get_model_kwargs()
    with torch.no_grad():
        logits = model(**batch_data).logits
    next_tokens = torch.argmax(logits, dim=-1)
    tokens = next_tokens.size(1)
    batch_processor.output_ids[:, :tokens].copy_(next_tokens)
    # record, for the self-check, the logits each decoding request samples from this step
    for i, state in enumerate(batch_processor.requests_in_batch):
        if len(state.remaining_prompt_ids) == 0:
            idx = int(batch_processor.logits_indices[i])
            step_log.setdefault(state.request_id, []).append(logits[0, idx].clone())


def main():
    config = LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa_paged"
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    dtype = torch.float32

    cache = PagedAttentionCache(config, block_size=4, num_blocks=20, max_batch_tokens=8,
                                device=torch.device("cpu"), dtype=dtype)
    input_queue, output_queue = queue.Queue(), queue.Queue()
    scheduler = FIFOScheduler(cache)
    bp = ContinuousBatchProcessor(cache, config, input_queue, output_queue, torch.device("cpu"), dtype, scheduler)

    g = torch.Generator().manual_seed(1)
    # (arrival step, prompt length, max_new_tokens): long prompts get split by the 8-token budget,
    # short max_new_tokens make requests leave early, late arrivals reuse the freed blocks
    plan = [(0, 5, 6), (0, 11, 4), (0, 3, 9), (2, 7, 5), (4, 13, 3), (6, 2, 7), (9, 9, 4), (12, 6, 6)]
    prompts = {}
    arrivals = {}
    for n, (step, plen, max_new) in enumerate(plan):
        ids = torch.randint(1, config.vocab_size, (plen,), generator=g).tolist()
        rid = f"req_{n}"
        prompts[rid] = ids
        arrivals.setdefault(step, []).append(
            RequestState(request_id=rid, full_prompt_ids=list(ids), prompt_ids=list(ids), max_new_tokens=max_new)
        )

    step_log = {}
    finished = {}
    step = 0
    max_blocks_seen_reused = 0
    freed_once = set()
    while step < 200:
        for st in arrivals.get(step, []):
            input_queue.put(st)
        if step > max(arrivals) and not bp.scheduler.has_pending_requests() and input_queue.empty():
            break
        bp.prepare_next_batch()
        if bp.requests_in_batch and bp.actual_tokens > 0:
            for st in bp.requests_in_batch:
                if any(b in freed_once for b in st.allocated_blocks):
                    max_blocks_seen_reused += 1
            generation_step(model, bp, step_log)
            bp.update_batch()
            bp.requests_in_batch = []
        while not output_queue.empty():
            st = output_queue.get_nowait()
            finished[st.request_id] = st
            freed_once.update(st.allocated_blocks)
        step += 1

    assert len(finished) == len(plan), (len(finished), len(plan))
    assert max_blocks_seen_reused > 0, "no request ran on reused blocks"

    # Reference: each request alone, its whole sequence prompt + generated tokens in one forward, plain
    # causal SDPA (is_causal=True), no padding, no mask tensor, no cache.
    def plain_causal_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        key = repeat_kv(key, module.num_key_value_groups)
        value = repeat_kv(value, module.num_key_value_groups)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    ALL_ATTENTION_FUNCTIONS["plain_causal"] = plain_causal_sdpa
    ref_config = copy.deepcopy(config)
    ref_config._attn_implementation = "plain_causal"
    ref_model = LlamaForCausalLM(ref_config).eval()
    ref_model.load_state_dict(model.state_dict())
    worst = 0.0
    for rid, st in finished.items():
        prompt = prompts[rid]
        gen = st.static_outputs
        assert len(gen) == st.max_new_tokens, (rid, len(gen), st.max_new_tokens)
        full = torch.tensor([prompt + gen])
        with torch.no_grad():
            ref_logits = ref_model(input_ids=full, position_ids=torch.arange(full.shape[1])[None]).logits[0]
        logged = step_log[rid]
        # logged[k] is the distribution after prompt + gen[:k]; the last one sampled a token that was dropped
        assert len(logged) == len(gen) + 1, (rid, len(logged), len(gen))
        for k in range(len(gen) + 1):
            ref = ref_logits[len(prompt) - 1 + k]
            worst = max(worst, (logged[k] - ref).abs().max().item())
            if k < len(gen):
                assert int(ref.argmax()) == gen[k], (rid, k)
        assert worst < 1e-4, (rid, worst)
    print(f"{len(finished)} requests, max |logit diff| vs per-request causal run = {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
