# hiyouga/LlamaFactory#10513 (commit 01398eb18, "[v1] fix padding free with sp").
#
# LlamaFactory v1 trains with Ulysses sequence parallelism (cp_size ranks) by swapping transformers'
# `_flash_attention_forward` for `new_flash_attn_forward` -> `UlyssesAttention`, which all-to-alls q/k/v from
# (seq/N, heads) to (seq, heads/N), all-gathers the padding mask and calls the original flash forward.
# With `batching_strategy: padding_free` the micro-batch is one row of packed samples: position_ids restart
# at 0 for each sample and attention_mask is all ones.
# Bug (before the fix): UlyssesAttention turned a missing mask into `torch.ones_like(position_ids)` (and kept the
# collator's all-ones mask), all-gathered it and handed that mask to `_flash_attention_forward`; a mask that is not
# None sends the call down the `_upad_input` path, which reads the whole packed row as ONE sequence, so every
# sample attends causally to the samples packed before it. The rank-local position_ids it passed along were never
# used to split the row.
# Fix: when position_ids are given, all-gather them to the full sequence and pass attention_mask=None, so
# `_flash_attention_forward` splits the row into its samples from the position ids (varlen, cu_seqlens).
#
# Ported: ulysses.py / seq_comm.py / sequence_parallel.py (new_flash_attn_forward, apply_sequence_parallel,
# padding_and_split_data, sequence_parallel_loss) and batching.py `_pack_padding_free_samples` as of 01398eb18^,
# trimmed. The model is a tiny transformers LlamaForCausalLM. There is no flash-attn on CPU: transformers'
# `_flash_attention_forward` is ported with its three branches (padding mask / packed position ids / dense) over
# CPU stand-ins for flash_attn_func / flash_attn_varlen_func; `_upad_input`, `_pad_input`, `_unpad_input`,
# `_prepare_from_posids`, `_is_packed_sequence` are transformers' own. The cp ranks run as threads of one process;
# `dist` below is a stand-in for torch.distributed whose collectives meet at a barrier.
import sys
import threading
from functools import partial
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

import transformers
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.modeling_flash_attention_utils import (
    _is_packed_sequence,
    _pad_input,
    _prepare_from_posids,
    _unpad_input,
    _upad_input,
)

FIXED = "--fixed" in sys.argv
torch.set_num_threads(1)
IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------------------------------
# torch.distributed stand-in: one thread per rank, collectives rendezvous on a barrier.
class _Group:
    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots = [None] * size


class _Dist:
    def __init__(self):
        self._local = threading.local()

    def set_rank(self, rank):
        self._local.rank = rank

    def get_world_size(self, group=None):
        return group.size

    def get_rank(self, group=None):
        return self._local.rank

    def all_gather(self, tensor_list, tensor, group=None):
        rank = self.get_rank(group)
        group.barrier.wait()
        group.slots[rank] = tensor.clone()
        group.barrier.wait()
        for i in range(group.size):
            tensor_list[i].copy_(group.slots[i])
        group.barrier.wait()

    def all_to_all(self, output_list, input_list, group=None):
        rank = self.get_rank(group)
        group.barrier.wait()
        group.slots[rank] = [t.clone() for t in input_list]
        group.barrier.wait()
        for j in range(group.size):
            output_list[j].copy_(group.slots[j][rank])
        group.barrier.wait()


dist = _Dist()
dist.ProcessGroup = _Group
dist.nn = SimpleNamespace()


def _nn_all_gather(tensor, group=None):
    out = [torch.empty_like(tensor) for _ in range(group.size)]
    dist.all_gather(out, tensor, group=group)
    return out


dist.nn.all_gather = _nn_all_gather


# ----------------------------------------------------------------------------------------------------------------
# CPU stand-ins for flash_attn's kernels (bottom-right causal, as flash-attn >= 2.1).
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):
    # (b, s, h, d)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale
    )
    return out.transpose(1, 2)


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, **kwargs
):
    # (total, h, d)
    out = torch.zeros_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi, ki, vi = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        mask = None
        if causal:
            lq, lk = qe - qs, ke - ks
            mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        out[qs:qe] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale).transpose(0, 1)
    return out


# transformers.modeling_flash_attention_utils._flash_attention_forward, trimmed to its three non-paged branches.
def _flash_attention_forward(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    query_length: int,
    is_causal: bool,
    dropout: float = 0.0,
    position_ids: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    deterministic: Optional[bool] = None,
    target_dtype: Optional[torch.dtype] = None,
    **kwargs,
):
    batch_size = query_states.size(0)
    flash_kwargs = {"dropout_p": dropout, "softmax_scale": softmax_scale, "causal": is_causal}

    # Contains at least one padding token in the sequence: unpad compute cu_seqlen and max_length from attention mask
    if attention_mask is not None:
        q, k, v, indices_q, (cu_seq_lens_q, cu_seq_lens_k), (max_length_q, max_length_k) = _upad_input(
            query_states, key_states, value_states, attention_mask, query_length, _unpad_input
        )
        out = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_seq_lens_q, cu_seqlens_k=cu_seq_lens_k,
            max_seqlen_q=max_length_q, max_seqlen_k=max_length_k, **flash_kwargs,
        )
        return _pad_input(out, indices_q, batch_size, query_length)

    # Padding free, but cu_seqlens or max_seqlen are not provided: infer them from position_ids
    if _is_packed_sequence(position_ids, batch_size):
        q, k, v, (cu_seq_lens_q, cu_seq_lens_k), (max_length_q, max_length_k) = _prepare_from_posids(
            query_states, key_states, value_states, position_ids
        )
        out = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_seq_lens_q, cu_seqlens_k=cu_seq_lens_k,
            max_seqlen_q=max_length_q, max_seqlen_k=max_length_k, **flash_kwargs,
        )
        return out.view(batch_size, -1, *out.shape[-2:])

    return flash_attn_func(query_states, key_states, value_states, **flash_kwargs)


# transformers.integrations.flash_attention.flash_attention_forward (it calls the module-level
# `_flash_attention_forward`, which is what apply_sequence_parallel swaps out).
def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                            **kwargs):
    seq_len = query.shape[2]
    query = query.transpose(1, 2)
    key = key.transpose(1, 2)
    value = value.transpose(1, 2)
    is_causal = is_causal if is_causal is not None else module.is_causal
    attn_output = _flash_attention_forward(
        query, key, value, attention_mask, query_length=seq_len, is_causal=is_causal, dropout=dropout,
        softmax_scale=scaling, target_dtype=None, **kwargs,
    )
    return attn_output, None


AttentionInterface.register("cpu_fa2_varlen", flash_attention_forward)
AttentionMaskInterface.register("cpu_fa2_varlen", flash_attention_mask)


# ----------------------------------------------------------------------------------------------------------------
# llamafactory/v1/plugins/model_plugins/parallelization/seq_comm.py
def all_to_all_tensor(local_input: Tensor, scatter_dim: int, gather_dim: int, group=None):
    seq_world_size = dist.get_world_size(group)
    input_list = [t.contiguous() for t in torch.tensor_split(local_input, seq_world_size, scatter_dim)]
    output_list = [torch.empty_like(input_list[0]) for _ in range(seq_world_size)]
    dist.all_to_all(output_list, input_list, group=group)
    return torch.cat(output_list, dim=gather_dim).contiguous()


class SeqAllToAll4D(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group, local_input: Tensor, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.group = group
        ctx.scatter_dim = scatter_dim
        ctx.gather_dim = gather_dim
        return all_to_all_tensor(local_input, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor):
        return (None, all_to_all_tensor(grad_output[0], ctx.gather_dim, ctx.scatter_dim, ctx.group), None, None)


# llamafactory/v1/plugins/model_plugins/parallelization/ulysses.py
_ULYSSES_SEQUENCE_PARALLEL_GROUP = None


def set_ulysses_sequence_parallel_group(group):
    global _ULYSSES_SEQUENCE_PARALLEL_GROUP
    _ULYSSES_SEQUENCE_PARALLEL_GROUP = group


def get_ulysses_sequence_parallel_group():
    return _ULYSSES_SEQUENCE_PARALLEL_GROUP


def get_ulysses_sequence_parallel_world_size(group=None) -> int:
    group = get_ulysses_sequence_parallel_group() if group is None else group
    return dist.get_world_size(group) if group else 1


def get_ulysses_sequence_parallel_rank(group=None) -> int:
    group = get_ulysses_sequence_parallel_group() if group is None else group
    return dist.get_rank(group) if group else 0


class UlyssesAttention(torch.nn.Module):
    def __init__(self, sequence_process_group=None, scatter_idx: int = 2, gather_idx: int = 1,
                 attn_fn: Optional[callable] = None) -> None:
        super().__init__()
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.attn_fn = attn_fn

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: torch.Tensor, query_length: int,
                dropout_p=0.0, softmax_scale=None, position_ids: Optional[torch.Tensor] = None, causal=True,
                deterministic=False, target_dtype=None, *args: Any) -> Tensor:
        # (bs, seq_len/N, head_cnt, head_size) -> (bs, seq_len, head_cnt/N, head_size)
        # scatter 2, gather 1
        q = SeqAllToAll4D.apply(self.spg, query, self.scatter_idx, self.gather_idx)
        k = SeqAllToAll4D.apply(self.spg, key, self.scatter_idx, self.gather_idx)
        v = SeqAllToAll4D.apply(self.spg, value, self.scatter_idx, self.gather_idx)

        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5

        if not FIXED:
            if attention_mask is None:
                if position_ids is not None:
                    attention_mask = torch.ones_like(position_ids).to(torch.int64)
                else:
                    attention_mask = torch.ones(q.shape[0], q.shape[1], dtype=torch.int64, device=q.device)
            else:
                attention_mask = attention_mask.to(torch.int64)

            global_attention_mask = [
                torch.empty_like(attention_mask) for _ in range(get_ulysses_sequence_parallel_world_size(self.spg))
            ]
            dist.all_gather(global_attention_mask, attention_mask, group=self.spg)
            attention_mask = torch.cat(global_attention_mask, dim=1)
        else:
            if position_ids is not None:
                global_position_ids = [
                    torch.empty_like(position_ids) for _ in range(get_ulysses_sequence_parallel_world_size(self.spg))
                ]
                dist.all_gather(global_position_ids, position_ids, group=self.spg)
                position_ids = torch.cat(global_position_ids, dim=-1).contiguous()
                attention_mask = None
            else:
                if attention_mask is None:
                    attention_mask = torch.ones(q.shape[0], q.shape[1], dtype=torch.int64, device=q.device)
                else:
                    attention_mask = attention_mask.to(torch.int64)

                global_attention_mask = [
                    torch.empty_like(attention_mask) for _ in range(get_ulysses_sequence_parallel_world_size(self.spg))
                ]
                dist.all_gather(global_attention_mask, attention_mask, group=self.spg)
                attention_mask = torch.cat(global_attention_mask, dim=1)

        context_layer = self.attn_fn(
            q,
            k,
            v,
            attention_mask,
            query_length=query_length,
            is_causal=causal,
            dropout=dropout_p,
            position_ids=position_ids,
            softmax_scale=softmax_scale,
            deterministic=deterministic,
            target_dtype=target_dtype,
        )

        if isinstance(context_layer, tuple):
            context_layer = context_layer[0]

        # (bs, seq_len, head_cnt/N, head_size) -> (bs, seq_len/N, head_cnt, head_size)
        output = SeqAllToAll4D.apply(self.spg, context_layer, self.gather_idx, self.scatter_idx)
        return output


# llamafactory/v1/plugins/model_plugins/parallelization/sequence_parallel.py
def new_flash_attn_forward(query_states, key_states, value_states, attention_mask, sequence_parallel_size=1,
                           dropout=0, deterministic=False, is_causal=True, group=None, mode="ulysses", attn_fn=None,
                           target_dtype=None, **kwargs):
    if mode == "ulysses":
        dist_attn = UlyssesAttention(sequence_process_group=group, attn_fn=attn_fn)
        attn_output = dist_attn(
            query_states,
            key_states,
            value_states,
            attention_mask,
            query_length=query_states.shape[1] * sequence_parallel_size,
            deterministic=deterministic,
            dropout_p=dropout,
            causal=is_causal,
            position_ids=kwargs.get("position_ids", None),
            target_dtype=target_dtype,
        )
    else:
        raise NotImplementedError("Other sequence parallel modes are to be implemented.")
    return attn_output


def apply_sequence_parallel(model, model_args, cp_group):
    cp_size = model_args.get("cp_size", 1)
    set_ulysses_sequence_parallel_group(cp_group)

    num_attention_heads, num_key_value_heads = model.config.num_attention_heads, model.config.num_attention_heads
    assert num_attention_heads % cp_size == 0, "num_attention_heads must be divisible by cp_size"
    assert num_key_value_heads % cp_size == 0 or cp_size % num_key_value_heads == 0

    module = sys.modules[__name__]
    origin_attn = module._flash_attention_forward
    new_flash_attention_forward = partial(
        new_flash_attn_forward,
        group=get_ulysses_sequence_parallel_group(),
        mode="ulysses",
        attn_fn=origin_attn,
        sequence_parallel_size=cp_size,
    )
    if getattr(module._flash_attention_forward, "__name__", "") == "_flash_attention_forward":
        module._flash_attention_forward = new_flash_attention_forward


class _DeviceMesh:
    def __init__(self, group):
        self.group = group

    def size(self):
        return self.group.size

    def get_local_rank(self):
        return dist.get_rank(self.group)

    def get_group(self):
        return self.group


def padding_and_split_data(data, device_mesh=None):
    if device_mesh is not None:
        cp_size = device_mesh.size()
        cp_rank = device_mesh.get_local_rank()
        cp_group = device_mesh.get_group()
        for k, v in data.items():
            if isinstance(v, torch.Tensor) and v.ndim > 1:
                data_len = torch.tensor(v.shape[-1], device=v.device, dtype=torch.int64)
                global_data_len = [torch.empty_like(data_len) for _ in range(cp_size)]
                dist.all_gather(global_data_len, data_len, group=cp_group)
                max_data_len = max(global_data_len)
                pad_size = max_data_len - v.shape[-1] + (cp_size - max_data_len % cp_size) % cp_size
                if k == "labels":
                    pad_value = -100
                elif k == "loss_weights":
                    pad_value = 0.0
                else:
                    pad_value = 0
                pad_data = F.pad(v, (0, int(pad_size)), value=pad_value)
                data[k] = torch.chunk(pad_data, chunks=cp_size, dim=-1)[cp_rank].contiguous()
    return data


def sequence_parallel_loss(model, model_inputs, device_mesh):
    model_inputs = {k: v for k, v in model_inputs.items() if isinstance(v, torch.Tensor)}
    model_inputs = padding_and_split_data(model_inputs, device_mesh)
    batch_size, _ = model_inputs["labels"].shape

    outputs = model(**model_inputs)
    logits = outputs.logits.float()
    labels = model_inputs["labels"]

    cp_group = get_ulysses_sequence_parallel_group()
    cp_world_size = get_ulysses_sequence_parallel_world_size(cp_group)
    cp_rank = get_ulysses_sequence_parallel_rank(cp_group)

    global_labels = [torch.empty_like(labels) for _ in range(cp_world_size)]
    dist.all_gather(global_labels, labels, group=cp_group)
    labels = torch.cat(global_labels, dim=1).contiguous()
    shift_labels = labels[..., 1:].contiguous()
    shift_labels = F.pad(shift_labels, (0, 1), value=-100)
    shift_labels = torch.chunk(shift_labels, chunks=cp_world_size, dim=1)[cp_rank].contiguous()

    loss_weights = model_inputs["loss_weights"]
    global_loss_weights = [torch.empty_like(loss_weights) for _ in range(cp_world_size)]
    dist.all_gather(global_loss_weights, loss_weights, group=cp_group)
    shift_loss_weights = torch.cat(global_loss_weights, dim=1).contiguous()
    shift_loss_weights = shift_loss_weights[..., 1:].contiguous()

    shift_logits = logits.view(-1, logits.size(-1)).contiguous()
    shift_labels = shift_labels.view(-1).contiguous()

    log_probs = -F.cross_entropy(shift_logits, shift_labels, reduction="none").view(batch_size, -1)
    global_log_probs = dist.nn.all_gather(log_probs, group=cp_group)
    global_log_probs = torch.cat(global_log_probs, dim=1).contiguous()
    log_probs = global_log_probs[..., :-1].contiguous()

    loss = (-log_probs * shift_loss_weights).sum() / (shift_loss_weights.sum() + 1e-6)
    return loss, global_log_probs


# llamafactory/v1/plugins/trainer_plugins/batching.py
def _pack_padding_free_samples(samples, cutoff_len):
    packed = {}
    position_ids = []
    for sample_index, sample in enumerate(samples):
        sample_len = min(len(sample["input_ids"]), cutoff_len)
        if sample_len <= 0:
            continue
        for key, value in sample.items():
            if key in ("attention_mask", "position_ids") or isinstance(value, str):
                continue
            if key not in packed:
                packed[key] = []
            sliced_value = list(value[:sample_len])
            if sample_index > 0 and sliced_value:
                if key == "labels":
                    sliced_value[0] = IGNORE_INDEX
                elif key == "loss_weights":
                    sliced_value[0] = 0.0
            packed[key].extend(sliced_value)
        position_ids.extend(range(sample_len))
    if not position_ids:
        return None
    packed["position_ids"] = position_ids
    packed["attention_mask"] = [1] * len(position_ids)
    return {key: torch.tensor(value).unsqueeze(0) for key, value in packed.items()}


def make_sample(prompt, response):
    ids = prompt + response
    return {
        "input_ids": ids,
        "attention_mask": [1] * len(ids),
        "labels": [IGNORE_INDEX] * len(prompt) + response,
        "loss_weights": [0.0] * len(prompt) + [1.0] * len(response),
    }


def main():
    torch.manual_seed(0)
    cp_size = 2
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0,
    )
    config._attn_implementation = "cpu_fa2_varlen"
    model = LlamaForCausalLM(config).eval()

    cp_group = _Group(cp_size)
    apply_sequence_parallel(model, {"cp_size": cp_size}, cp_group)

    samples = [
        make_sample([5, 17, 9], [33, 41]),
        make_sample([7, 12], [50, 21, 3]),
        make_sample([44, 8], [19, 60, 27, 11]),
    ]
    micro_batch = _pack_padding_free_samples(samples, cutoff_len=32)  # 16 tokens, one row
    print("position_ids", micro_batch["position_ids"].tolist())

    results = [None] * cp_size
    errors = []

    def run_rank(rank):
        try:
            dist.set_rank(rank)
            batch = {k: v.clone() for k, v in micro_batch.items()}
            with torch.no_grad():
                results[rank] = sequence_parallel_loss(model, batch, _DeviceMesh(cp_group))
        except BaseException as exc:  # surface errors from the rank threads
            errors.append(exc)
            cp_group.barrier.abort()

    threads = [threading.Thread(target=run_rank, args=(r,)) for r in range(cp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]

    loss, token_log_probs = results[0]
    print("token log-probs", [round(x, 4) for x in token_log_probs[0].tolist()])
    print("loss", round(loss.item(), 6))


if __name__ == "__main__":
    main()
