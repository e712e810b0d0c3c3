"""Picotron context parallelism: ring attention over 2 gloo processes on the CPU, one training step.

Citation: huggingface/picotron @59714b1bf25541dbeb6f5a721ed15f6d0768e786
  picotron/process_group_manager.py  ProcessGroupManager (dp x pp x cp x tp grid, cp_group,
                                     cp_send_rank = next rank in the ring, cp_recv_rank = previous)
  picotron/context_parallel/cp_communications.py  ContextCommunicate (send_recv queues a P2POp
                                     isend/irecv pair, commit = batch_isend_irecv, wait)
  picotron/context_parallel/context_parallel.py   apply_context_parallel, RingAttentionFunc
                                     (forward: step 0 is the rank's own K/V block with the causal
                                     triu mask, later blocks are attended unmasked while step <= rank
                                     and skipped after; backward the same way), ring_attention_forward,
                                     ring_attention_backward, update_out_and_lse,
                                     update_rope_for_context_parallel (each rank's cos/sin rows)
  picotron/model.py                  get_cos_sin, apply_rotary_pos_emb, LlamaRMSNorm, Attention
                                     (FLASH_ATTEN=0 branch), MLP, FinalProjection, DecoderLayer, Llama
  picotron/data.py                   MicroBatchDataLoader.collate_batch (the rank's contiguous slice of
                                     the seq_length + 1 tokens, targets shifted by one)
  train.py                           train_step (cross entropy over the local slice, backward);
                                     picotron/utils.py average_loss_across_dp_cp_ranks

Run as train.py runs with distributed.use_cpu: backend gloo, DEVICE=cpu, DTYPE=float32,
FLASH_ATTEN=0, tp = pp = dp = 1, cp = 2, the two processes started here with
torch.multiprocessing.spawn. Two changes for the CPU: ContextCommunicate.wait only calls
torch.cuda.synchronize when CUDA exists, and the gradients are averaged over the cp_dp group by one
all_reduce per parameter after backward (what picotron's DataParallelBucket does in its hooks).
The model config is a tiny transformers LlamaConfig (rope_theta read back from rope_parameters,
where transformers 5 keeps it).

Each rank checks (float32, 1e-4) its logits, the averaged loss and every averaged gradient against
the same weights run on the whole sequence in one process, attention written as a double loop over
query and key positions (key j seen by query i iff j <= i).
"""
import argparse
import math
import os
import socket
import sys
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig

# `import picotron.process_group_manager as pgm`: this module holds the global manager.
pgm = sys.modules[__name__]
process_group_manager = None


# --- picotron/process_group_manager.py ---------------------------------------------------------

class ProcessGroupManager:
    def __init__(self, tp_size, cp_size, pp_size, dp_size):
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.global_rank % self.world_size))

        assert self.world_size == tp_size * cp_size * pp_size * dp_size, f"World size ({self.world_size}) != TP ({tp_size}) * CP ({cp_size}) * PP ({pp_size}) * DP ({dp_size})"

        self.grid = torch.arange(self.world_size).view(dp_size, pp_size, cp_size, tp_size)  # DP * PP * CP * TP grid
        # Find the position of the current process in the grid
        self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank = (self.grid == self.global_rank).nonzero().flatten().tolist()

        # Process group creation - Update indexing to match new grid order
        self.tp_group = dist.new_subgroups_by_enumeration([self.grid[d, p, c, :].tolist() for d in range(dp_size) for p in range(pp_size) for c in range(cp_size)])[0]
        self.cp_group = dist.new_subgroups_by_enumeration([self.grid[d, p, :, t].tolist() for d in range(dp_size) for p in range(pp_size) for t in range(tp_size)])[0]
        self.pp_group = dist.new_subgroups_by_enumeration([self.grid[d, :, c, t].tolist() for d in range(dp_size) for c in range(cp_size) for t in range(tp_size)])[0]
        self.dp_group = dist.new_subgroups_by_enumeration([self.grid[:, p, c, t].tolist() for p in range(pp_size) for c in range(cp_size) for t in range(tp_size)])[0]
        self.cp_dp_group = dist.new_subgroups_by_enumeration([self.grid[:, p, :, t].flatten().tolist() for p in range(pp_size) for t in range(tp_size)])[0]

        self.world_group = dist.group.WORLD

        self.tp_group_ids = self.grid[self.dp_rank, self.pp_rank, self.cp_rank, :].tolist()
        self.cp_group_ids = self.grid[self.dp_rank, self.pp_rank, :, self.tp_rank].tolist()
        self.pp_group_ids = self.grid[self.dp_rank, :, self.cp_rank, self.tp_rank].tolist()
        self.dp_group_ids = self.grid[:, self.pp_rank, self.cp_rank, self.tp_rank].tolist()
        self.cp_dp_group_ids = self.grid[:, self.pp_rank, :, self.tp_rank].flatten().tolist()

        # Tensor parallelism
        self.tp_world_size = dist.get_world_size(group=self.tp_group)

        # Context parallelism
        self.cp_world_size = dist.get_world_size(group=self.cp_group)
        self.cp_first_rank = self.cp_group_ids[0]
        self.cp_last_rank = self.cp_group_ids[-1]
        self.cp_send_rank = self.cp_group_ids[(self.cp_rank + 1) % self.cp_world_size]
        self.cp_recv_rank = self.cp_group_ids[(self.cp_rank - 1) % self.cp_world_size]

        # Pipeline parallelism
        self.pp_world_size = dist.get_world_size(group=self.pp_group)
        self.pp_is_last_stage = self.pp_rank == self.pp_world_size - 1

        # Data parallelism
        self.dp_world_size = dist.get_world_size(group=self.dp_group)

        # Context + Data paralellism
        self.cp_dp_world_size = dist.get_world_size(group=self.cp_dp_group)

    def __str__(self):
        return f"TP({self.tp_world_size})-CP({self.cp_world_size})-PP({self.pp_world_size})-DP({self.dp_world_size})-Rank({self.global_rank})"


def setup_process_group_manager(tp_size, cp_size, pp_size, dp_size):
    global process_group_manager
    process_group_manager = ProcessGroupManager(tp_size, cp_size, pp_size, dp_size)


# --- picotron/context_parallel/cp_communications.py --------------------------------------------

class ContextCommunicate:
    def __init__(self, msg: str = ""):
        self._pending_operations: List[dist.P2POp] = []
        self._active_requests = None
        self.rank = pgm.process_group_manager.cp_rank
        self.world_size = pgm.process_group_manager.cp_world_size
        self.send_rank = pgm.process_group_manager.cp_send_rank
        self.recv_rank = pgm.process_group_manager.cp_recv_rank

    def send_recv(self, tensor_to_send, recv_tensor=None):
        if recv_tensor is None:
            result_tensor = torch.zeros_like(tensor_to_send)
        else:
            result_tensor = recv_tensor

        send_operation = dist.P2POp(dist.isend, tensor_to_send, self.send_rank, group=pgm.process_group_manager.cp_group)
        recv_operation = dist.P2POp(dist.irecv, result_tensor, self.recv_rank, group=pgm.process_group_manager.cp_group)

        self._pending_operations.extend([send_operation, recv_operation])
        return result_tensor

    def commit(self):
        if self._active_requests is not None: raise RuntimeError("Commit called twice")
        self._active_requests = dist.batch_isend_irecv(self._pending_operations)

    def wait(self):
        if self._active_requests is None: raise RuntimeError("Wait called before commit")
        for request in self._active_requests:
            request.wait()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._active_requests = None
        self._pending_operations = []


# --- picotron/context_parallel/context_parallel.py ---------------------------------------------

def apply_context_parallel(model):
    os.environ["CONTEXT_PARALLEL"] = "1" if pgm.process_group_manager.cp_world_size > 1 else "0"
    return model


def ring_attention(q, k, v, sm_scale, is_causal):
    return RingAttentionFunc.apply(q, k, v, sm_scale, is_causal)


class RingAttentionFunc(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, sm_scale, is_causal):
        comm = ContextCommunicate("comm")
        k_og = k.clone()
        v_og = v.clone()
        out, lse = None, None
        next_k, next_v = None, None

        for step in range(comm.world_size):
            if step + 1 != comm.world_size:
                next_k = comm.send_recv(k)
                next_v = comm.send_recv(v)
                comm.commit()

            if not is_causal or step <= comm.rank:
                block_out, block_lse = ring_attention_forward(
                    q, k, v, sm_scale, is_causal and step == 0
                )
                out, lse = update_out_and_lse(out, lse, block_out, block_lse)

            if step + 1 != comm.world_size:
                comm.wait()
                k = next_k
                v = next_v

        out = out.to(q.dtype)
        ctx.save_for_backward(q, k_og, v_og, out, lse.squeeze(-1))
        ctx.sm_scale = sm_scale
        ctx.is_causal = is_causal
        return out

    @staticmethod
    def backward(ctx, dout, *args):

        q, k, v, out, softmax_lse = ctx.saved_tensors
        sm_scale = ctx.sm_scale
        is_causal = ctx.is_causal

        kv_comm = ContextCommunicate("kv_comm")
        d_kv_comm = ContextCommunicate("d_kv_comm")
        dq, dk, dv = None, None, None
        next_dk, next_dv = None, None

        next_k, next_v = None, None

        for step in range(kv_comm.world_size):
            if step + 1 != kv_comm.world_size:
                next_k = kv_comm.send_recv(k)
                next_v = kv_comm.send_recv(v)
                kv_comm.commit()

            if step <= kv_comm.rank or not is_causal:
                bwd_causal = is_causal and step == 0

                block_dq_buffer, block_dk_buffer, block_dv_buffer = ring_attention_backward(
                    dout, q, k, v, out, softmax_lse, sm_scale, bwd_causal
                )

                if dq is None:
                    dq = block_dq_buffer.to(torch.float32)
                    dk = block_dk_buffer.to(torch.float32)
                    dv = block_dv_buffer.to(torch.float32)
                else:
                    dq += block_dq_buffer
                    d_kv_comm.wait()
                    dk = block_dk_buffer + next_dk
                    dv = block_dv_buffer + next_dv
            elif step != 0:
                d_kv_comm.wait()
                dk = next_dk
                dv = next_dv

            if step + 1 != kv_comm.world_size:
                kv_comm.wait()
                k = next_k
                v = next_v

            next_dk = d_kv_comm.send_recv(dk)
            next_dv = d_kv_comm.send_recv(dv)
            d_kv_comm.commit()

        d_kv_comm.wait()

        return dq, next_dk, next_dv, None, None


def ring_attention_forward(q, k, v, sm_scale, is_causal):
    batch_size, nheads, seqlen, d = q.shape
    S = torch.matmul(q, k.transpose(-2, -1)) * sm_scale

    if is_causal:
        causal_mask = torch.triu(torch.ones(seqlen, seqlen, device=q.device, dtype=torch.bool), diagonal=1)
        causal_mask = causal_mask.unsqueeze(0).unsqueeze(1).expand(batch_size, nheads, seqlen, seqlen)
        S.masked_fill_(causal_mask, float('-inf'))

    # Online softmax
    S_max = torch.max(S, dim=-1, keepdim=True)[0]
    exp_S = torch.exp(S - S_max)
    exp_sum = torch.sum(exp_S, dim=-1, keepdim=True)
    log_sum_exp = torch.log(exp_sum) + S_max
    P = exp_S / exp_sum
    O = torch.matmul(P, v)
    return O, log_sum_exp.squeeze(-1)


def ring_attention_backward(dO, Q, K, V, O, softmax_lse, sm_scale, is_causal):
    batch_size, nheads, seqlen, d = Q.shape

    # Recreate S and P from log_sum_exp
    S = torch.matmul(Q, K.transpose(-2, -1)) * sm_scale
    if is_causal:
        causal_mask = torch.triu(torch.ones(seqlen, seqlen, device=Q.device, dtype=torch.bool), diagonal=1)
        S = S.masked_fill(causal_mask.unsqueeze(0).unsqueeze(1), float('-inf'))

    P = torch.exp(S - softmax_lse.unsqueeze(-1))
    dV = torch.matmul(P.transpose(-2, -1), dO)
    dP = torch.matmul(dO, V.transpose(-2, -1))
    D = torch.sum(dO * O, dim=-1, keepdim=True)
    dS = P * (dP - D)
    if is_causal:
        dS = dS.masked_fill(causal_mask.unsqueeze(0).unsqueeze(1), 0)
    dQ = torch.matmul(dS, K) * sm_scale
    dK = torch.matmul(dS.transpose(-2, -1), Q) * sm_scale
    return dQ, dK, dV


def update_out_and_lse(
    out: Optional[torch.Tensor],
    lse: Optional[torch.Tensor],
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    slice_: Optional[Any] = None
) -> Tuple[torch.Tensor, torch.Tensor]:

    def _update(current_out, current_lse):
        # new_lse = lse + torch.log(1 + torch.exp(block_lse - lse))
        # out = torch.exp(lse - new_lse) * out + torch.exp(block_lse - new_lse) * block_out
        current_out = current_out - F.sigmoid(block_lse - current_lse) * (current_out - block_out)
        current_lse = current_lse - F.logsigmoid(current_lse - block_lse)
        return current_out, current_lse

    block_out = block_out.to(torch.float32)
    block_lse = block_lse.unsqueeze(dim=-1)

    if out is None:
        if slice_ is not None:
            raise RuntimeError("first update_out_and_lse should not pass slice_ args")
        return block_out, block_lse

    if slice_ is not None:
        out[slice_], lse[slice_] = _update(out[slice_], lse[slice_])
    else:
        out, lse = _update(out, lse)

    return out, lse


def update_rope_for_context_parallel(cos, sin):
    seq_len, _ = cos.size()
    cp_rank, cp_word_size = pgm.process_group_manager.cp_rank, pgm.process_group_manager.cp_world_size
    assert seq_len % cp_word_size == 0, f"Input sequence length ({seq_len}) must be divisible by cp_world_size ({cp_word_size})"
    size_per_partition = seq_len // cp_word_size
    start_idx, end_idx = cp_rank * size_per_partition, (cp_rank + 1) * size_per_partition
    return cos[start_idx:end_idx], sin[start_idx:end_idx]


# --- picotron/model.py (FLASH_ATTEN=0) ---------------------------------------------------------

def apply_rotary_pos_emb(x, cos, sin):
    batch_size, num_head, seq_length, head_dim = x.size()
    x1 = x[..., : head_dim // 2]
    x2 = x[..., head_dim // 2 :]
    rotate_half = torch.cat([-x2, x1], dim=-1)
    x = x * cos + rotate_half * sin
    return x


def get_cos_sin(seq_length, head_dim, base=500000.0):
    assert head_dim % 2 == 0
    theta = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float().to('cpu') / head_dim))
    dtype = torch.bfloat16 if os.getenv('DTYPE', 'bfloat16') == 'bfloat16' else torch.float32
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device('cuda', local_rank) if os.getenv('DEVICE', 'cuda') == 'cuda' else torch.device('cpu')
    position = torch.arange(seq_length).to(device).unsqueeze(1).float()  # [seq_length, 1]
    theta = theta.to(device)
    return torch.cos(position.float() * theta.float()).to(dtype).repeat(1, 2), torch.sin(position.float() * theta.float()).to(dtype).repeat(1, 2)  # [seq_length, head_dim], [seq_length, head_dim]


def _init_weights(tensor):
    k = 1 / tensor.size(1)
    bound = math.sqrt(k)
    torch.nn.init.uniform_(tensor, -bound, bound)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.variance_epsilon = eps
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_key_values = config.num_key_value_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_local_heads = config.num_attention_heads // pgm.process_group_manager.tp_world_size  # TP parallelism
        self.num_local_kv_heads = config.num_key_value_heads // pgm.process_group_manager.tp_world_size  # TP parallelism

        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_values * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_values * self.head_dim, bias=False)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.layer_idx = layer_idx
        self.reset_parameters()

    def reset_parameters(self):
        _init_weights(self.q_proj.weight)
        _init_weights(self.k_proj.weight)
        _init_weights(self.v_proj.weight)
        _init_weights(self.out_proj.weight)

    def forward(self, x, cos, sin, attention_mask=None, position_ids=None):
        batch_size, seq_length, hidden_dim = x.size()
        q = self.q_proj(x)  # [batch_size, seq_length, num_heads*head_dim]
        k = self.k_proj(x)  # [batch_size, seq_length, num_key_values*head_dim]
        v = self.v_proj(x)  # [batch_size, seq_length, num_key_values*head_dim]
        q = q.view(batch_size, seq_length, self.num_local_heads, self.head_dim).transpose(1, 2)  # [batch_size, num_heads, seq_length, head_dim]
        k = k.view(batch_size, seq_length, self.num_local_kv_heads, self.head_dim).transpose(1, 2)  # [batch_size, num_key_values, seq_length, head_dim]
        v = v.view(batch_size, seq_length, self.num_local_kv_heads, self.head_dim).transpose(1, 2)  # [batch_size, num_key_values, seq_length, head_dim]
        q = apply_rotary_pos_emb(q, cos, sin)
        k = apply_rotary_pos_emb(k, cos, sin)

        k = k.repeat_interleave(self.num_local_heads // self.num_local_kv_heads, dim=1)  # [batch_size, num_heads, seq_length, head_dim]
        v = v.repeat_interleave(self.num_local_heads // self.num_local_kv_heads, dim=1)  # [batch_size, num_heads, seq_length, head_dim]

        causal = True if q.size(2) == k.size(2) else False  # During decoding phase. The lenghth of q is usually 1.

        if os.getenv('CONTEXT_PARALLEL', '0') == '1':
            # Ring attention for context parallelism
            sm_scale = 1.0 / (q.size(-1) ** 0.5)
            out = ring_attention(q, k, v, sm_scale, causal).transpose(1, 2)  # [batch_size, seq_length, num_heads, head_dim]
        else:
            # Pytorch scaled dot product attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # [batch_size, num_heads, seq_length, head_dim]
            out = out.transpose(1, 2)  # [batch_size, seq_length, num_heads, head_dim]

        out = out.reshape(batch_size, seq_length, self.num_local_heads * self.head_dim)  # [batch_size, seq_length, hidden_dim]
        out = self.out_proj(out)  # [batch_size, seq_length, hidden_dim]
        return out


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self):
        _init_weights(self.up_proj.weight)
        _init_weights(self.gate_proj.weight)
        _init_weights(self.down_proj.weight)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FinalProjection(nn.Module):
    def __init__(self, hidden_size, vocab_size, bias=False):
        super().__init__()
        self.in_features = hidden_size
        self.out_features = vocab_size
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features))
        self.bias = None
        self.reset_parameters()

    def reset_parameters(self):
        _init_weights(self.weight)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class DecoderLayer(nn.Module):
    # RMSNorm -> Attention -> Residual -> RMSNorm -> MLP -> Residual
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention = Attention(config, layer_idx=layer_idx)
        self.mlp = MLP(config)
        self.layer_idx = layer_idx
        head_dim = config.hidden_size // config.num_attention_heads
        self.cos, self.sin = get_cos_sin(config.max_position_embeddings, head_dim=head_dim, base=config.rope_theta)  # [max_position_embeddings, head_dim]

        # For context parallelism, we split the input. We need to get the correct cos and sin for each split
        self.cos, self.sin = update_rope_for_context_parallel(self.cos, self.sin)

    def forward(self, x, attention_mask=None, position_ids=None):
        cos, sin = self.cos, self.sin
        x = x + self.attention(self.input_layernorm(x), cos, sin, attention_mask, position_ids)  # Attention
        x = x + self.mlp(self.post_attention_layernorm(x))  # MLP
        return x


class Embedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, padding_idx=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.normal_(self.weight, mean=0.0, std=1.0)

    def forward(self, x):
        return F.embedding(x, self.weight, self.padding_idx,)


class Llama(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        assert config.hidden_size % config.num_attention_heads == 0
        assert config.num_attention_heads % config.num_key_value_heads == 0

        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.num_layers = config.num_hidden_layers
        self.model_config = config

        self.embedding = Embedding(self.vocab_size, self.hidden_size)
        self.decoder_layers = nn.ModuleList([DecoderLayer(config, layer_idx=i) for i in range(self.num_layers)])
        self.final_proj = FinalProjection(self.hidden_size, self.vocab_size, bias=False)
        self.final_norm = LlamaRMSNorm(self.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, attention_mask=None, position_ids: torch.Tensor = None):
        x = self.embedding(input_ids)
        for layer in self.decoder_layers:
            x = layer(x)  # [batch_size, seq_length, hidden_dim]
        x = self.final_norm(x)
        logits = self.final_proj(x)
        return logits  # [batch_size, seq_length, vocab_size]


# --- picotron/data.py MicroBatchDataLoader.collate_batch --------------------------------------

def collate_batch(batch_input_ids, seq_length_per_gpu):
    batch_size = batch_input_ids.size(0)
    start_idx = pgm.process_group_manager.cp_rank * seq_length_per_gpu
    end_idx = start_idx + seq_length_per_gpu
    input_ids = batch_input_ids[:, start_idx:end_idx].contiguous()
    target_ids = batch_input_ids[:, start_idx + 1:end_idx + 1].contiguous()
    position_ids = torch.arange(start_idx, end_idx, dtype=torch.long).unsqueeze(0).expand(batch_size, -1).contiguous()
    return {"input_ids": input_ids, "target_ids": target_ids, "position_ids": position_ids, "hidden_states": None}


# --- train.py train_step / picotron/utils.py average_loss_across_dp_cp_ranks -----------------

def train_step(model, batch):
    input_ids = batch["input_ids"]
    target_ids = batch["target_ids"]
    outputs = model(input_ids=input_ids)
    batch_size, seq_len = input_ids.shape
    target_ids = target_ids.reshape(-1)
    flat = outputs.view(seq_len * batch_size, -1)
    loss = F.cross_entropy(flat, target_ids, reduction='mean')
    loss.backward()
    return outputs.detach(), loss.item()


def average_loss_across_dp_cp_ranks(loss):
    reduced_loss = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float32)
    if pgm.process_group_manager.pp_is_last_stage:
        dist.all_reduce(reduced_loss, op=dist.ReduceOp.SUM, group=pgm.process_group_manager.cp_dp_group)
        reduced_loss /= pgm.process_group_manager.cp_dp_world_size
    return reduced_loss.item()


def average_grads_across_dp_cp_ranks(model):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=pgm.process_group_manager.cp_dp_group)
        p.grad /= pgm.process_group_manager.cp_dp_world_size


# --- reference: the whole sequence in one process, causal attention as a double loop ---------

def reference_logits(model, input_ids, config):
    batch_size, seq_length = input_ids.shape
    head_dim = config.hidden_size // config.num_attention_heads
    cos, sin = get_cos_sin(seq_length, head_dim=head_dim, base=config.rope_theta)  # every position, no split
    x = model.embedding(input_ids)
    for layer in model.decoder_layers:
        attn = layer.attention
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(batch_size, seq_length, attn.num_heads, head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(batch_size, seq_length, attn.num_key_values, head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(batch_size, seq_length, attn.num_key_values, head_dim).transpose(1, 2)
        q = apply_rotary_pos_emb(q, cos, sin)
        k = apply_rotary_pos_emb(k, cos, sin)
        group = attn.num_heads // attn.num_key_values
        out = torch.zeros_like(q)
        for head in range(attn.num_heads):
            kv_head = head // group
            for i in range(seq_length):
                keys = [j for j in range(seq_length) if j <= i]
                scores = torch.stack([(q[:, head, i] * k[:, kv_head, j]).sum(-1) for j in keys], dim=-1) / math.sqrt(head_dim)
                weights = torch.softmax(scores, dim=-1)
                out[:, head, i] = sum(weights[:, n, None] * v[:, kv_head, j] for n, j in enumerate(keys))
        out = out.transpose(1, 2).reshape(batch_size, seq_length, attn.hidden_size)
        x = x + attn.out_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.final_proj(model.final_norm(x))


def close(a, b, tol=1e-4):
    return torch.allclose(a, b, rtol=tol, atol=tol)


def run(rank, world_size, port):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank),
        DEVICE="cpu", DTYPE="float32", FLASH_ATTEN="0",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    setup_process_group_manager(tp_size=1, cp_size=world_size, pp_size=1, dp_size=1)

    seq_length, micro_batch_size = 16, 2
    model_config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
    )
    model_config.rope_theta = model_config.rope_parameters["rope_theta"]
    model_config.max_position_embeddings = seq_length

    torch.manual_seed(0)  # every rank builds the same weights (set_all_seed in train.py)
    model = Llama(config=model_config)
    model = apply_context_parallel(model)

    # one micro batch of seq_length + 1 tokens, as tokenizer_group_text chunks the text
    tokens = torch.randint(0, model_config.vocab_size, (micro_batch_size, seq_length + 1), generator=torch.Generator().manual_seed(1))
    seq_length_per_gpu = seq_length // pgm.process_group_manager.cp_world_size
    batch = collate_batch(tokens, seq_length_per_gpu)

    logits, loss = train_step(model, batch)
    loss = average_loss_across_dp_cp_ranks(loss)
    average_grads_across_dp_cp_ranks(model)
    cp_grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad()
    full_logits = reference_logits(model, tokens[:, :seq_length], model_config)
    ref_loss = F.cross_entropy(full_logits.reshape(-1, model_config.vocab_size), tokens[:, 1:].reshape(-1))
    ref_loss.backward()

    start = pgm.process_group_manager.cp_rank * seq_length_per_gpu
    assert close(logits, full_logits[:, start:start + seq_length_per_gpu].detach()), f"rank {rank}: logits differ"
    assert abs(loss - ref_loss.item()) < 1e-4, f"rank {rank}: loss {loss} vs {ref_loss.item()}"
    for name, p in model.named_parameters():
        assert close(cp_grads[name], p.grad), f"rank {rank}: grad of {name} differs"
    dist.barrier()
    if rank == 0:
        print(f"cp={world_size}: every rank's logits, the loss {loss:.5f} and {len(cp_grads)} averaged grads match the whole-sequence run")
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--cp", type=int, default=2)
    args = parser.parse_args()
    mp.spawn(run, args=(args.cp, args.port or free_port()), nprocs=args.cp)
