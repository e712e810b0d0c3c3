"""swiftLLM (interestingLSY/swiftLLM), a tiny vLLM-style serving engine, shrunk to CPU.

Ported from interestingLSY/swiftLLM:
  swiftllm/worker/model.py @12130937ce0961be733859781cf7d159447a1081 (LlamaModel.forward / _forward:
      prefill sequences first, decoding sequences after, prefill_seq_start_locs(_with_end),
      position_indices, allocate_blocks_for_seqs, the seq_block_size heuristic)
  swiftllm/worker/layers/transformer_layer.py @1ba5cfec694006407d71b0ab1e30907ef8d6f5fa
      (store_kvcache, then flash_attn_varlen_func(causal=True) over the prefill tokens and
      paged_attention over the cache for the decoding tokens)
  swiftllm/worker/infer_state.py @1ba5cfec694006407d71b0ab1e30907ef8d6f5fa (LlamaInferState)
  swiftllm/worker/kernels/kvcache_mgmt.py @65a9bc2602ffaf36e3ae782b57a3bb26268b1839
  swiftllm/worker/kernels/paged_attn.py @0a7924b52adeb82a2fedf7419b5ed2752b5b5e03
      (phase 1: one partial softmax per seq block, tokens past decoding_seq_len set to -1e20;
      phase 2: log-sum-exp merge of the seq blocks)
  swiftllm/worker/kernels/rotary_emb.py @7c443f53b3612183c0b8fe9930e981a65eaa98b7
  swiftllm/worker/layers/post_layer.py @62ac9bf19ca1ae9780c01aae7aa63c37a8428147
  swiftllm/worker/block_manager.py @1940e591850c3a9dc1befa16fcaa5566d2bd60b9

The Triton kernels are written as torch loops with the same indexing, vllm_flash_attn's
flash_attn_varlen_func is a CPU stand-in (one causal SDPA call per cu_seqlens segment), the
model is a random tiny Llama in float64, and the scheduler is a small continuous-batching loop
(requests arrive at different steps, a prefill joins the running decodes in one batch, finished
requests give their blocks and block-table rows back and later requests reuse them).

Checked against each request generated alone with no cache: a dense Llama whose causal mask is
built by a double loop, recomputing the whole sequence every step; tokens and logits must match.
"""
import dataclasses
import itertools
import math

import torch
import torch.nn.functional as F

DEVICE = "cpu"
DTYPE = torch.float64


def cdiv(a, b):
    return (a + b - 1) // b


@dataclasses.dataclass
class LlamaModelConfig:
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    hidden_size: int = 64
    head_dim: int = 16
    ffn_inter_dim: int = 96
    vocab_size: int = 101
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: float = 1.0
    max_position_embeddings: int = 256


@dataclasses.dataclass
class EngineConfig:
    block_size: int = 4
    max_blocks_per_seq: int = 48
    max_seqs_in_block_table: int = 4
    num_gpu_blocks: int = 96
    max_batch_size: int = 4
    max_tokens_in_batch: int = 160


@dataclasses.dataclass
class LlamaInferState:
    batch_size: int
    num_tokens: int

    seq_ids: torch.Tensor   # [batch_size]
    softmax_scale: float    # Equal to 1/sqrt(head_dim)

    num_prefill_seqs: int
    num_prefill_tokens: int
    prefill_seq_start_locs: torch.Tensor # [batch_size]
    prefill_seq_start_locs_with_end: torch.Tensor # [batch_size+1], = prefill_seq_start_locs + [num_prefill_tokens]
    prefill_seq_lens: torch.Tensor # [batch_size]
    max_prefill_len: int

    num_decoding_seqs: int
    decoding_seq_lens: torch.Tensor # [batch_size]
    max_decoding_len: int

    seq_block_size: int
    num_seq_blocks: int

    position_cos: torch.Tensor  # [num_tokens, head_dim//2]
    position_sin: torch.Tensor  # [num_tokens, head_dim//2]

    ignore_kvcache: bool    # Skip storing the key/value cache, useful when profiling the number of kv blocks


# ---------------------------------------------------------------- kernels (torch stand-ins)

def linear(a, w):
    return a @ w.t()


def rmsnorm_forward(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def fused_add_rmsnorm_inplace(buf, residual, w, eps):
    residual += buf
    buf.copy_(rmsnorm_forward(residual, w, eps))


def silu_and_mul_inplace(x):
    half = x.shape[-1] // 2
    x[:, :half] = F.silu(x[:, :half]) * x[:, half:]


def rotary_embedding_inplace(q, k, infer_state):
    half = q.shape[-1] // 2
    cos = infer_state.position_cos[:, None, :]
    sin = infer_state.position_sin[:, None, :]
    for t in (q, k):
        t0 = t[..., :half].clone()
        t1 = t[..., half:].clone()
        t[..., :half] = t0 * cos - t1 * sin
        t[..., half:] = t0 * sin + t1 * cos


def store_kvcache(k, v, k_cache, v_cache, block_table, model_config, engine_config, infer_state, cur_layer):
    block_size = engine_config.block_size
    # _fwd_kvcache_mgmt_prefill_kernel: token i of prefill seq b goes to
    # block_table[seq_id, i // block_size], offset i % block_size
    for my_batch_id in range(infer_state.num_prefill_seqs):
        my_seq_id = int(infer_state.seq_ids[my_batch_id])
        my_seq_len = int(infer_state.prefill_seq_lens[my_batch_id])
        my_seq_start_loc = int(infer_state.prefill_seq_start_locs[my_batch_id])
        for my_block_id in range(cdiv(my_seq_len, block_size)):
            my_block_index = int(block_table[my_seq_id, my_block_id])
            lo = my_block_id * block_size
            hi = min(lo + block_size, my_seq_len)
            k_cache[my_block_index, cur_layer, :, : hi - lo, :] = k[my_seq_start_loc + lo: my_seq_start_loc + hi].transpose(0, 1)
            v_cache[my_block_index, cur_layer, :, : hi - lo, :] = v[my_seq_start_loc + lo: my_seq_start_loc + hi].transpose(0, 1)
    # _fwd_kvcache_mgmt_decoding_kernel: the new token sits at decoding_seq_len - 1
    for my_batch_id in range(infer_state.num_decoding_seqs):
        my_seq_id = int(infer_state.seq_ids[infer_state.num_prefill_seqs + my_batch_id])
        my_seq_len = int(infer_state.decoding_seq_lens[my_batch_id])
        my_block_index = int(block_table[my_seq_id, (my_seq_len - 1) // block_size])
        my_block_offset = (my_seq_len - 1) % block_size
        k_cache[my_block_index, cur_layer, :, my_block_offset, :] = k[infer_state.num_prefill_tokens + my_batch_id]
        v_cache[my_block_index, cur_layer, :, my_block_offset, :] = v[infer_state.num_prefill_tokens + my_batch_id]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False):
    """CPU stand-in for vllm_flash_attn.flash_attn_varlen_func (packed, GQA)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for b in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        qb = q[qs:qe].transpose(0, 1)
        kb = k[ks:ke].repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[ks:ke].repeat_interleave(group, dim=1).transpose(0, 1)
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=softmax_scale)
        out[qs:qe] = ob.transpose(0, 1)
    return out


def paged_attention(q, k_cache, v_cache, block_table, model_config, engine_config, infer_state, cur_layer, o):
    block_size = engine_config.block_size
    seq_block_size = infer_state.seq_block_size
    num_seq_blocks = infer_state.num_seq_blocks
    num_my_heads = model_config.num_q_heads // model_config.num_kv_heads
    scale = infer_state.softmax_scale * 1.442695040888963  # Since we are going to use log2

    mid_o = torch.zeros((infer_state.num_decoding_seqs, model_config.num_q_heads, num_seq_blocks, model_config.head_dim), dtype=q.dtype)
    mid_o_logexpsum = torch.zeros((infer_state.num_decoding_seqs, model_config.num_q_heads, num_seq_blocks), dtype=q.dtype)

    # phase 1, grid [num_decoding_seqs, num_q_heads, num_seq_blocks] (heads vectorised here)
    for my_batch_id in range(infer_state.num_decoding_seqs):
        my_seq_id = int(infer_state.seq_ids[infer_state.num_prefill_seqs + my_batch_id])
        my_seq_len = int(infer_state.decoding_seq_lens[my_batch_id])
        my_q = q[my_batch_id]  # [num_q_heads, head_dim]
        for my_seq_block_id in range(num_seq_blocks):
            my_start_token_idx = my_seq_block_id * seq_block_size
            if my_start_token_idx >= my_seq_len:
                continue
            start_block_idx = my_seq_block_id * (seq_block_size // block_size)
            if my_start_token_idx + seq_block_size > my_seq_len:
                my_num_blocks = cdiv(my_seq_len - my_start_token_idx, block_size)
            else:
                my_num_blocks = seq_block_size // block_size
            max_score = torch.full((model_config.num_q_heads,), -1e20, dtype=q.dtype)
            sum_exp = torch.zeros((model_config.num_q_heads,), dtype=q.dtype)
            acc = torch.zeros((model_config.num_q_heads, model_config.head_dim), dtype=q.dtype)
            for block_i in range(my_num_blocks):
                block_index = int(block_table[my_seq_id, start_block_idx + block_i])
                k_block = k_cache[block_index, cur_layer].repeat_interleave(num_my_heads, dim=0)  # [num_q_heads, block_size, head_dim]
                v_block = v_cache[block_index, cur_layer].repeat_interleave(num_my_heads, dim=0)
                attn_score = (my_q[:, None, :] * k_block).sum(-1) * scale  # [num_q_heads, block_size]
                offs_token = block_i * block_size + my_start_token_idx + torch.arange(block_size)
                attn_score = torch.where(offs_token[None, :] < my_seq_len, attn_score, torch.tensor(-1e20, dtype=q.dtype))
                new_max_score = torch.maximum(max_score, attn_score.max(-1).values)
                exp_attn_score = torch.exp2(attn_score - new_max_score[:, None])
                old_acc_scale = torch.exp2(max_score - new_max_score)
                acc = acc * old_acc_scale[:, None] + (exp_attn_score[:, :, None] * v_block).sum(1)
                sum_exp = sum_exp * old_acc_scale + exp_attn_score.sum(-1)
                max_score = new_max_score
            mid_o[my_batch_id, :, my_seq_block_id] = acc / sum_exp[:, None]
            mid_o_logexpsum[my_batch_id, :, my_seq_block_id] = torch.log2(sum_exp) + max_score

    # phase 2, grid [num_decoding_seqs, num_q_heads]
    for my_batch_id in range(infer_state.num_decoding_seqs):
        my_num_seq_blocks = cdiv(int(infer_state.decoding_seq_lens[my_batch_id]), seq_block_size)
        max_score = torch.full((model_config.num_q_heads,), -1e20, dtype=q.dtype)
        sum_exp = torch.zeros((model_config.num_q_heads,), dtype=q.dtype)
        acc = torch.zeros((model_config.num_q_heads, model_config.head_dim), dtype=q.dtype)
        for seq_block_id in range(my_num_seq_blocks):
            cur_mid_o = mid_o[my_batch_id, :, seq_block_id]
            cur_lse = mid_o_logexpsum[my_batch_id, :, seq_block_id]
            new_max_score = torch.maximum(max_score, cur_lse)
            old_scale = torch.exp2(max_score - new_max_score)
            exp_score = torch.exp2(cur_lse - new_max_score)
            acc = acc * old_scale[:, None] + exp_score[:, None] * cur_mid_o
            sum_exp = sum_exp * old_scale + exp_score
            max_score = new_max_score
        o[my_batch_id] = (acc / sum_exp[:, None]).reshape(-1)


# ---------------------------------------------------------------- block manager

class BlockManager:
    """(seq_id, block_index) |-> block_id, plus the free-block list (swiftllm/worker/block_manager.py)."""

    def __init__(self, num_blocks, max_seqs_in_block_table, max_blocks_per_seq, block_size):
        self.num_free_blocks = num_blocks
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_seq_allocated_blocks = torch.zeros((max_seqs_in_block_table,), dtype=torch.int32)
        self.block_table = torch.zeros((max_seqs_in_block_table, max_blocks_per_seq), dtype=torch.int32)
        self.is_block_free = torch.ones((num_blocks,), dtype=torch.bool)

    def _allocate_blocks(self, num_blocks):
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"No enough free blocks available ({self.num_blocks} in total, {self.num_free_blocks} free, {num_blocks} requested)")
        selected_blocks = torch.nonzero(self.is_block_free)[:num_blocks].view(-1)
        self.num_free_blocks -= num_blocks
        self.is_block_free[selected_blocks] = False
        return selected_blocks

    def allocate_blocks_for_seqs(self, seq_ids, target_lens):
        target_num_blocks = (target_lens + (self.block_size - 1)) // self.block_size
        assert (self.num_seq_allocated_blocks[seq_ids] <= target_num_blocks).all()
        block_needed = target_num_blocks - self.num_seq_allocated_blocks[seq_ids]
        new_blocks = self._allocate_blocks(int(torch.sum(block_needed)))
        # set_block_table_and_num_seq_alloc_blocks
        cursor = 0
        for seq_id, needed in zip(seq_ids.tolist(), block_needed.tolist()):
            start = int(self.num_seq_allocated_blocks[seq_id])
            self.block_table[seq_id, start:start + needed] = new_blocks[cursor:cursor + needed].to(torch.int32)
            self.num_seq_allocated_blocks[seq_id] += needed
            cursor += needed

    def free_blocks_for_seqs(self, seq_ids):
        self.num_free_blocks += int(torch.sum(self.num_seq_allocated_blocks[seq_ids]))
        # unset_block_table_and_num_seq_alloc_blocks
        for seq_id in seq_ids.tolist():
            n = int(self.num_seq_allocated_blocks[seq_id])
            self.is_block_free[self.block_table[seq_id, :n].long()] = True
            self.num_seq_allocated_blocks[seq_id] = 0


# ---------------------------------------------------------------- model

@dataclasses.dataclass
class LlamaTransformerLayerWeight:
    attn_norm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    ffn_norm: torch.Tensor
    up_gate_proj: torch.Tensor
    down_proj: torch.Tensor


@dataclasses.dataclass
class LlamaWeight:
    wte: torch.Tensor
    layers: list
    final_norm: torch.Tensor
    lm_head: torch.Tensor


def load_weights(cfg: LlamaModelConfig, seed=0):
    """use_dummy=True: random weights instead of a checkpoint."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.08):
        return torch.randn(*shape, generator=g, dtype=DTYPE) * std

    layers = [
        LlamaTransformerLayerWeight(
            attn_norm=1.0 + rnd(cfg.hidden_size, std=0.1),
            q_proj=rnd(cfg.num_q_heads * cfg.head_dim, cfg.hidden_size, std=0.25),
            k_proj=rnd(cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, std=0.25),
            v_proj=rnd(cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, std=0.25),
            o_proj=rnd(cfg.hidden_size, cfg.num_q_heads * cfg.head_dim, std=0.15),
            ffn_norm=1.0 + rnd(cfg.hidden_size, std=0.1),
            up_gate_proj=rnd(2 * cfg.ffn_inter_dim, cfg.hidden_size, std=0.15),
            down_proj=rnd(cfg.hidden_size, cfg.ffn_inter_dim, std=0.15),
        )
        for _ in range(cfg.num_layers)
    ]
    return LlamaWeight(
        wte=rnd(cfg.vocab_size, cfg.hidden_size, std=1.0),
        layers=layers,
        final_norm=1.0 + rnd(cfg.hidden_size, std=0.1),
        lm_head=rnd(cfg.vocab_size, cfg.hidden_size, std=0.5),
    )


class LlamaTransformerLayer:
    def __init__(self, model_config, engine_config, weight, layer_id):
        self.model_config = model_config
        self.engine_config = engine_config
        self.weight = weight
        self.layer_id = layer_id

    def forward(self, input_embds, residual_buf, k_cache, v_cache, block_table, infer_state):
        cfg = self.model_config
        fused_add_rmsnorm_inplace(input_embds, residual_buf, self.weight.attn_norm, cfg.rms_norm_eps)

        q = linear(input_embds, self.weight.q_proj).view(-1, cfg.num_q_heads, cfg.head_dim)
        k = linear(input_embds, self.weight.k_proj).view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = linear(input_embds, self.weight.v_proj).view(-1, cfg.num_kv_heads, cfg.head_dim)

        rotary_embedding_inplace(q, k, infer_state)

        if not infer_state.ignore_kvcache:
            store_kvcache(k, v, k_cache, v_cache, block_table, cfg, self.engine_config, infer_state, self.layer_id)

        o = input_embds    # [num_total_tokens, hidden_size]
        if infer_state.num_prefill_seqs > 0:
            o[:infer_state.num_prefill_tokens, :] = flash_attn_varlen_func(
                q[:infer_state.num_prefill_tokens, :, :],
                k[:infer_state.num_prefill_tokens, :, :],
                v[:infer_state.num_prefill_tokens, :, :],
                infer_state.prefill_seq_start_locs_with_end,
                infer_state.prefill_seq_start_locs_with_end,
                infer_state.max_prefill_len,
                infer_state.max_prefill_len,
                softmax_scale=infer_state.softmax_scale,
                causal=True,
            ).reshape(-1, cfg.hidden_size)
        if infer_state.num_decoding_seqs > 0:
            assert not infer_state.ignore_kvcache
            paged_attention(
                q[infer_state.num_prefill_tokens:, :, :],
                k_cache, v_cache, block_table,
                cfg, self.engine_config, infer_state,
                self.layer_id,
                o[infer_state.num_prefill_tokens:, :],
            )

        o = linear(o, self.weight.o_proj)
        fused_add_rmsnorm_inplace(o, residual_buf, self.weight.ffn_norm, cfg.rms_norm_eps)
        up_gate_proj = linear(o, self.weight.up_gate_proj)
        silu_and_mul_inplace(up_gate_proj)
        return linear(up_gate_proj[:, :cfg.ffn_inter_dim], self.weight.down_proj)


class LlamaPostLayer:
    def __init__(self, model_config, weights):
        self.model_config = model_config
        self.weights = weights

    def forward(self, input_embds, infer_state):
        last_token_indices = torch.cat((
            infer_state.prefill_seq_start_locs + infer_state.prefill_seq_lens - 1,
            torch.arange(infer_state.num_prefill_tokens, infer_state.num_tokens, dtype=torch.int32),
        ), dim=0)
        last_input = input_embds[last_token_indices.long(), :]
        last_input = rmsnorm_forward(last_input, self.weights.final_norm, self.model_config.rms_norm_eps)
        return linear(last_input, self.weights.lm_head)    # [batch_size, vocab_size]


class LlamaModel:
    def __init__(self, model_config: LlamaModelConfig, engine_config: EngineConfig):
        self.model_config = model_config
        self.engine_config = engine_config
        self.weight = load_weights(model_config)
        self._init_to_get_rotary()
        self.transformer_layers = [
            LlamaTransformerLayer(model_config, engine_config, self.weight.layers[i], i)
            for i in range(model_config.num_layers)
        ]
        self.post_layer = LlamaPostLayer(model_config, self.weight)
        self.last_logits = None

    def init_kvcache(self, num_blocks):
        shape = (num_blocks, self.model_config.num_layers, self.model_config.num_kv_heads,
                 self.engine_config.block_size, self.model_config.head_dim)
        self.k_cache = torch.zeros(shape, dtype=DTYPE)
        self.v_cache = torch.zeros(shape, dtype=DTYPE)
        self.gpu_block_manager = BlockManager(num_blocks, self.engine_config.max_seqs_in_block_table,
                                              self.engine_config.max_blocks_per_seq, self.engine_config.block_size)

    def _init_to_get_rotary(self):
        cfg = self.model_config
        max_seq_len = int(cfg.max_position_embeddings * cfg.rope_scaling)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=DTYPE) / cfg.head_dim))
        t = torch.arange(max_seq_len + 128, dtype=DTYPE) / cfg.rope_scaling
        freqs = torch.outer(t, inv_freq)
        self._cos_cached = torch.cos(freqs)
        self._sin_cached = torch.sin(freqs)

    def _forward(self, input_ids, infer_state):
        input_embds = self.weight.wte[input_ids.long()]
        residual_buf = torch.zeros_like(input_embds)
        for layer in self.transformer_layers:
            input_embds = layer.forward(input_embds, residual_buf, self.k_cache, self.v_cache,
                                        self.gpu_block_manager.block_table, infer_state)
        input_embds += residual_buf
        return self.post_layer.forward(input_embds, infer_state)

    @torch.inference_mode()
    def forward(self, input_ids_list, seq_ids_list, decoding_seq_lens_list):
        num_prefill_seqs = len(input_ids_list) - len(decoding_seq_lens_list)
        flattened_input_ids = list(itertools.chain(*input_ids_list))
        seq_lengths_list = [len(seq) for seq in input_ids_list[:num_prefill_seqs]] + decoding_seq_lens_list

        seq_ids = torch.tensor(seq_ids_list, dtype=torch.int32)
        seq_lengths = torch.tensor(seq_lengths_list, dtype=torch.int32)

        batch_size = len(input_ids_list)
        num_tokens = len(flattened_input_ids)

        prefill_seq_lens_list = seq_lengths_list[:num_prefill_seqs]
        prefill_seq_lens = torch.tensor(prefill_seq_lens_list, dtype=torch.int32)
        prefill_start_locs = torch.cumsum(prefill_seq_lens, dim=0, dtype=torch.int32) - prefill_seq_lens
        max_prefill_len = max(prefill_seq_lens_list) if prefill_seq_lens_list else 0

        decoding_seq_lens = torch.tensor(decoding_seq_lens_list, dtype=torch.int32)
        max_decoding_len = max(decoding_seq_lens_list) if decoding_seq_lens_list else 0

        position_indices = torch.cat((
            torch.concat([torch.arange(0, n, dtype=torch.int32) for n in prefill_seq_lens_list])
            if prefill_seq_lens_list else torch.empty(0, dtype=torch.int32),
            decoding_seq_lens - 1,
        ), dim=0).long()

        self.gpu_block_manager.allocate_blocks_for_seqs(seq_ids, seq_lengths)

        # largest seq_block_size (a multiple of block_size, at least 8 blocks) that keeps
        # the number of phase-1 programs up; shrunk from 2048/64/1024 for the tiny model
        seq_block_size = 256
        decoding_seq_lens_sum = sum(decoding_seq_lens_list)
        while self.model_config.num_kv_heads * (decoding_seq_lens_sum / seq_block_size) < 64 and \
                seq_block_size // 2 >= 8 * self.engine_config.block_size and \
                max_decoding_len / (seq_block_size // 2) <= 128:
            seq_block_size //= 2

        infer_state = LlamaInferState(
            batch_size=batch_size,
            num_tokens=num_tokens,
            seq_ids=seq_ids,
            softmax_scale=self.model_config.head_dim ** -0.5,
            num_prefill_seqs=num_prefill_seqs,
            num_prefill_tokens=num_tokens - (batch_size - num_prefill_seqs),
            prefill_seq_start_locs=prefill_start_locs,
            prefill_seq_start_locs_with_end=torch.cat([prefill_start_locs, torch.tensor([num_tokens], dtype=torch.int32)]),
            prefill_seq_lens=prefill_seq_lens,
            max_prefill_len=max_prefill_len,
            num_decoding_seqs=batch_size - num_prefill_seqs,
            decoding_seq_lens=decoding_seq_lens,
            max_decoding_len=max_decoding_len,
            seq_block_size=seq_block_size,
            num_seq_blocks=(max_decoding_len + seq_block_size - 1) // seq_block_size,
            position_cos=self._cos_cached[position_indices],
            position_sin=self._sin_cached[position_indices],
            ignore_kvcache=False,
        )
        logits = self._forward(torch.tensor(flattened_input_ids, dtype=torch.int32), infer_state)
        self.last_logits = logits
        return torch.argmax(logits, dim=1).tolist()

    def free_seqs_resources(self, seq_ids_list):
        self.gpu_block_manager.free_blocks_for_seqs(torch.tensor(seq_ids_list, dtype=torch.int32))


# ---------------------------------------------------------------- engine (continuous batching)

@dataclasses.dataclass
class Request:
    request_id: int
    arrival_step: int
    prompt_token_ids: list
    output_len: int
    seq_id: int = -1
    output_token_ids: list = dataclasses.field(default_factory=list)
    step_logits: list = dataclasses.field(default_factory=list)

    def is_finished(self):
        return len(self.output_token_ids) >= self.output_len

    def get_cur_output_len(self):
        return len(self.output_token_ids)


class Engine:
    def __init__(self, model: LlamaModel, engine_config: EngineConfig):
        self.model = model
        self.engine_config = engine_config
        self.waiting = []
        self.running = []
        self.free_seq_ids = list(range(engine_config.max_seqs_in_block_table))
        self.finished = []
        self.batches = []

    def add_request(self, req):
        self.waiting.append(req)

    def _admit(self, step):
        """Take arrived requests FCFS while the batch's tokens, sequences and blocks allow."""
        cfg = self.engine_config
        new_reqs = []
        num_tokens = len(self.running)
        free_blocks = self.model.gpu_block_manager.num_free_blocks - len(self.running)
        while self.waiting and self.waiting[0].arrival_step <= step:
            req = self.waiting[0]
            need_blocks = cdiv(len(req.prompt_token_ids) + req.output_len, cfg.block_size)
            if (len(self.running) + len(new_reqs) + 1 > cfg.max_batch_size
                    or num_tokens + len(req.prompt_token_ids) > cfg.max_tokens_in_batch
                    or not self.free_seq_ids or need_blocks > free_blocks):
                break
            self.waiting.pop(0)
            req.seq_id = self.free_seq_ids.pop(0)
            num_tokens += len(req.prompt_token_ids)
            free_blocks -= need_blocks
            new_reqs.append(req)
        return new_reqs

    def step(self, step):
        prefill_reqs = self._admit(step)
        decoding_reqs = list(self.running)
        if not prefill_reqs and not decoding_reqs:
            return
        input_ids_list = [r.prompt_token_ids for r in prefill_reqs] + [[r.output_token_ids[-1]] for r in decoding_reqs]
        seq_ids_list = [r.seq_id for r in prefill_reqs + decoding_reqs]
        decoding_seq_lens_list = [len(r.prompt_token_ids) + r.get_cur_output_len() for r in decoding_reqs]
        self.batches.append(([r.request_id for r in prefill_reqs], [r.request_id for r in decoding_reqs]))

        output_tokens = self.model.forward(input_ids_list, seq_ids_list, decoding_seq_lens_list)
        logits = self.model.last_logits

        finished_seq_ids = []
        for i, (req, tok) in enumerate(zip(prefill_reqs + decoding_reqs, output_tokens)):
            req.output_token_ids.append(tok)
            req.step_logits.append(logits[i].clone())
        self.running = [r for r in self.running + prefill_reqs if not r.is_finished()]
        for req in prefill_reqs + decoding_reqs:
            if req.is_finished():
                finished_seq_ids.append(req.seq_id)
                self.finished.append(req)
        if finished_seq_ids:
            self.model.free_seqs_resources(finished_seq_ids)
            self.free_seq_ids = sorted(self.free_seq_ids + finished_seq_ids)

    def run(self, max_steps=500):
        step = 0
        while (self.waiting or self.running) and step < max_steps:
            self.step(step)
            step += 1
        assert not self.waiting and not self.running


# ---------------------------------------------------------------- reference: one request, no cache

def reference_generate(weight: LlamaWeight, cfg: LlamaModelConfig, prompt, output_len):
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=DTYPE) / cfg.head_dim))
    half = cfg.head_dim // 2
    group = cfg.num_q_heads // cfg.num_kv_heads
    total = len(prompt) + output_len
    causal_allowed = torch.tensor([[j <= i for j in range(total)] for i in range(total)])

    def rope(x, pos):
        ang = pos[:, None].to(DTYPE) * inv_freq[None, :]
        cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        x0, x1 = x[..., :half], x[..., half:]
        return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    def full_forward(tokens):
        n = len(tokens)
        pos = torch.arange(n)
        allowed = causal_allowed[:n, :n]
        h = weight.wte[torch.tensor(tokens)]
        for lw in weight.layers:
            x = rms(h, lw.attn_norm)
            q = rope((x @ lw.q_proj.t()).view(n, cfg.num_q_heads, cfg.head_dim), pos)
            k = rope((x @ lw.k_proj.t()).view(n, cfg.num_kv_heads, cfg.head_dim), pos)
            v = (x @ lw.v_proj.t()).view(n, cfg.num_kv_heads, cfg.head_dim)
            heads = []
            for hq in range(cfg.num_q_heads):
                hk = hq // group
                s = (q[:, hq] @ k[:, hk].t()) / math.sqrt(cfg.head_dim)
                s = s.masked_fill(~allowed, float("-inf"))
                heads.append(torch.softmax(s, dim=-1) @ v[:, hk])
            h = h + torch.cat(heads, dim=-1) @ lw.o_proj.t()
            x = rms(h, lw.ffn_norm)
            gu = x @ lw.up_gate_proj.t()
            h = h + (F.silu(gu[:, :cfg.ffn_inter_dim]) * gu[:, cfg.ffn_inter_dim:]) @ lw.down_proj.t()
        return rms(h[-1], weight.final_norm) @ weight.lm_head.t()

    tokens = list(prompt)
    out, logits_list = [], []
    for _ in range(output_len):
        logits = full_forward(tokens)
        tok = int(torch.argmax(logits))
        out.append(tok)
        logits_list.append(logits)
        tokens.append(tok)
    return out, logits_list


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model_config = LlamaModelConfig()
    engine_config = EngineConfig()
    model = LlamaModel(model_config, engine_config)
    model.init_kvcache(engine_config.num_gpu_blocks)
    engine = Engine(model, engine_config)

    g = torch.Generator().manual_seed(1)
    # (arrival step, prompt length, output length): prompts of different lengths, some not a
    # multiple of block_size, arriving while others decode; 6 requests over 4 block-table rows
    specs = [(0, 37, 30), (0, 9, 12), (2, 70, 20), (5, 3, 16), (6, 22, 9), (14, 51, 25)]
    requests = []
    for rid, (arrival, plen, olen) in enumerate(specs):
        prompt = torch.randint(0, model_config.vocab_size, (plen,), generator=g).tolist()
        req = Request(rid, arrival, prompt, olen)
        requests.append(req)
        engine.add_request(req)

    engine.run()

    mixed = sum(1 for p, d in engine.batches if p and d)
    multi_prefill = sum(1 for p, d in engine.batches if len(p) > 1)
    print(f"{len(engine.batches)} engine steps, {mixed} mixing a prefill with decodes, "
          f"{multi_prefill} with several prefills")
    assert mixed > 0 and multi_prefill > 0
    assert model.gpu_block_manager.num_free_blocks == engine_config.num_gpu_blocks

    max_err = 0.0
    for req in requests:
        ref_tokens, ref_logits = reference_generate(model.weight, model_config, req.prompt_token_ids, req.output_len)
        assert req.output_token_ids == ref_tokens, (req.request_id, req.output_token_ids, ref_tokens)
        for a, b in zip(req.step_logits, ref_logits):
            max_err = max(max_err, float((a - b).abs().max()))
        print(f"request {req.request_id}: prompt {len(req.prompt_token_ids):3d} tokens, seq_id {req.seq_id}, "
              f"output {req.output_token_ids[:8]}...")
    print(f"max |logits - reference| = {max_err:.2e}")
    assert max_err < 1e-9
    print("OK: paged engine matches each request generated alone")


if __name__ == "__main__":
    main()
