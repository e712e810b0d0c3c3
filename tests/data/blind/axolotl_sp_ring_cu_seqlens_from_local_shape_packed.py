# axolotl sequence parallelism (axolotl-ai-cloud/axolotl#2495, commit 59cd47250 "SP cu_seqlens fix, refactor").
# With sample packing and sequence_parallel_degree > 1, the multipack row is sliced per rank by the collator and
# ring-flash-attn's llama3 varlen attention reads its boundaries from update_ring_flash_attn_params(cu_seqlens).
# Before the fix SequenceParallelMixin._update_ring_flash_attn_params built cu_seqlens from the *local* input shape,
# [0, local_len, total_len], so the packed samples' boundaries were dropped and the cut between ranks became a
# boundary, and the collator shifted every position_ids segment on rank > 0 by -start_idx. The fix computes cu_seqlens
# from the full row's position_ids (get_cu_seqlens_from_pos_ids) before slicing, and slices position_ids unchanged.
# Ranks are threads here; ring-flash-attn's hf_adapter and llama3 varlen forward are ported over a plain-torch varlen
# kernel (the flash-attn call), with the all-gather done between the threads.
import sys
import threading
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

SEQUENCE_PARALLEL_DEGREE = 2


# ---- torch.distributed stand-in: the ring group's ranks are threads ----------------------------------------------
class _ThreadGroup:
    def __init__(self, world_size):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.slots = [None] * world_size
        self.local = threading.local()


class _ThreadDist:
    def get_rank(self, group=None):
        return group.local.rank

    def get_world_size(self, group=None):
        return group.world_size

    def all_gather_into_tensor(self, output, input, group=None):
        group.slots[group.local.rank] = input.clone()
        group.barrier.wait()
        output.copy_(torch.cat(group.slots, dim=0))
        group.barrier.wait()


dist = _ThreadDist()
RING_ATTN_GROUP = None


def get_ring_attn_group():
    return RING_ATTN_GROUP


# ---- ring_flash_attn (llama3_flash_attn_varlen.py, adapters/hf_adapter.py) -------------------------------------------
def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size=(-1, -1), alibi_slopes=None, return_softmax=False):
    # flash_attn varlen kernel: one causal (bottom-right aligned) attention per (cu_seqlens_q[i], cu_seqlens_k[i]) pair
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        if qe == qs or ke == ks:
            continue
        qi, ki, vi = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        scores = (qi @ ki.transpose(-1, -2)).float() * softmax_scale
        if causal:
            lq, lk = qe - qs, ke - ks
            allowed = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
            scores = scores.masked_fill(~allowed, float("-inf"))
        seg_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - seg_lse[..., None]).nan_to_num(0.0)
        out[qs:qe] = (probs.to(vi.dtype) @ vi).transpose(0, 1)
        lse[:, qs:qe] = seg_lse
    return out, lse


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size):
    total_length = cu_seqlens[-1].item()
    assert total_length % world_size == 0
    length_per_rank = total_length // world_size
    left = torch.searchsorted(cu_seqlens, rank * length_per_rank)
    right = torch.searchsorted(cu_seqlens, (rank + 1) * length_per_rank)

    # after this, cu_seqlens[left:right + 1] contains all the sequence for this rank
    if cu_seqlens[left] != rank * length_per_rank:
        left -= 1
    left = left.item()
    right = right.item()

    # q is always the same. just calculate the cu_seqlens for the local slice
    cu_seqlens_q = cu_seqlens[left: right + 1].clone()
    cu_seqlens_q -= rank * length_per_rank
    cu_seqlens_q[0] = 0
    cu_seqlens_q[-1] = length_per_rank

    cu_seqlens_k = cu_seqlens[left: right + 1].clone()
    if causal:
        # when causal, we hope
        # - the last k seq is of the same length as the last q seq
        slice_right = (rank + 1) * length_per_rank
        cu_seqlens_k[-1] = slice_right
    else:
        # when not causal, we hope
        # - the last k is full seq
        slice_right = cu_seqlens[right].item()

    slice_left = cu_seqlens[left].item()
    cu_seqlens_k -= slice_left

    max_seqlen_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()
    max_seqlen_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item()
    local_k_slice = slice(slice_left, slice_right)
    return cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice


def llama3_flash_attn_varlen_forward(process_group, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     heads_k_stride, local_k_slice, softmax_scale, dropout_p=0, causal=True,
                                     window_size=(-1, -1), alibi_slopes=None, deterministic=False):
    out_list = []
    lse_list = []

    nheads = q.shape[1]
    total_k, nheads_k, head_dim = k.shape
    assert nheads_k % heads_k_stride == 0

    world_size = dist.get_world_size(process_group)
    kv_buffer = torch.empty((2, total_k * world_size, heads_k_stride, head_dim), dtype=k.dtype, device=k.device)

    for i in range(0, nheads_k, heads_k_stride):
        q_i = q[:, i * nheads // nheads_k: (i + heads_k_stride) * nheads // nheads_k]
        k_i = k[:, i: i + heads_k_stride].contiguous()
        v_i = v[:, i: i + heads_k_stride].contiguous()

        dist.all_gather_into_tensor(kv_buffer[0], k_i, group=process_group)
        dist.all_gather_into_tensor(kv_buffer[1], v_i, group=process_group)

        k_i = kv_buffer[0][local_k_slice]
        v_i = kv_buffer[1][local_k_slice]

        out, lse = _flash_attn_varlen_forward(
            q=q_i, k=k_i, v=v_i, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, alibi_slopes=alibi_slopes, return_softmax=True and dropout_p > 0)
        out_list.append(out)
        lse_list.append(lse)

    out = torch.cat(out_list, dim=1)
    lse = torch.cat(lse_list, dim=0)
    return out, lse


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, heads_k_stride,
                                  local_k_slice, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None):
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    out, _ = llama3_flash_attn_varlen_forward(
        group, q, k.contiguous(), v.contiguous(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        heads_k_stride, local_k_slice, softmax_scale=softmax_scale, dropout_p=dropout_p, causal=causal,
        window_size=window_size, alibi_slopes=alibi_slopes, deterministic=False)
    return out


class _PerRankParams:
    # hf_adapter's module-level DATA_PARAMS dict; one per process there, one per rank thread here
    def __init__(self):
        self.by_rank = {}

    def update(self, values):
        self.by_rank.setdefault(RING_ATTN_GROUP.local.rank, {}).update(values)

    def __getitem__(self, key):
        return self.by_rank[RING_ATTN_GROUP.local.rank][key]


DATA_PARAMS = _PerRankParams()


def update_ring_flash_attn_params(cu_seqlens, process_group):
    world_size = dist.get_world_size(group=process_group)
    rank = dist.get_rank(group=process_group)
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
     local_k_slice) = llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, True, rank, world_size)
    DATA_PARAMS.update({
        "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_k": cu_seqlens_k,
        "max_seqlen_q": max_seqlen_q,
        "max_seqlen_k": max_seqlen_k,
        "local_k_slice": local_k_slice,
    })


def create_ring_flash_attention_forward(process_group, heads_k_stride):

    def _flash_attention_forward(query_states, key_states, value_states, attention_mask, query_length, is_causal,
                                 dropout=0.0, position_ids=None, softmax_scale=None, sliding_window=None,
                                 use_top_left_mask=False, softcap=None, deterministic=None, **kwargs):
        causal = is_causal
        assert causal, "only causal attention is supported yet."
        batch_size = query_states.size(0)
        assert batch_size == 1, "varlen data should be processed in advance."

        attn_output = llama3_flash_attn_varlen_func(
            query_states.squeeze(dim=0),
            key_states.squeeze(dim=0),
            value_states.squeeze(dim=0),
            cu_seqlens_q=DATA_PARAMS["cu_seqlens_q"],
            cu_seqlens_k=DATA_PARAMS["cu_seqlens_k"],
            max_seqlen_q=DATA_PARAMS["max_seqlen_q"],
            max_seqlen_k=DATA_PARAMS["max_seqlen_k"],
            heads_k_stride=heads_k_stride,
            local_k_slice=DATA_PARAMS["local_k_slice"],
            dropout_p=dropout,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=(-1, -1),
            alibi_slopes=None,
            deterministic=deterministic,
            return_attn_probs=False,
            group=process_group,
        )
        return attn_output.unsqueeze(dim=0)

    return _flash_attention_forward


def substitute_hf_flash_attn(process_group, heads_k_stride):
    _flash_attention_forward = create_ring_flash_attention_forward(process_group, heads_k_stride)

    # transformers' integrations/flash_attention.py flash_attention_forward, calling the substituted function
    def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                sliding_window=None, softcap=None, **kwargs):
        seq_len = query.shape[2]
        query = query.transpose(1, 2)
        key = key.transpose(1, 2)
        value = value.transpose(1, 2)
        attn_output = _flash_attention_forward(
            query, key, value, attention_mask, query_length=seq_len, is_causal=module.is_causal, dropout=dropout,
            softmax_scale=scaling, sliding_window=sliding_window, softcap=softcap, **kwargs)
        return attn_output, None

    AttentionInterface.register("ring_attn_varlen_llama3", flash_attention_forward)
    AttentionMaskInterface.register("ring_attn_varlen_llama3", flash_attention_mask)


# ---- axolotl: monkeypatch/utils.py, monkeypatch/attention/ring_attn.py, utils/collators/batching.py ------------------
def get_cu_seqlens_from_pos_ids(position_ids):
    """generate a cumulative sequence length mask for flash attention using pos ids"""
    if len(position_ids.shape) == 1:
        position_ids = position_ids.unsqueeze(0)

    device = position_ids.device
    results = []
    max_seq_lens = []

    for row in position_ids:
        # Count the number of consecutive zeros from the right side
        padding_length = (row == 0).int().flip(dims=[0]).cumprod(dim=0).sum().item()

        # Adjust the row to exclude padding
        adjusted_row = row[:-padding_length] if padding_length else row.clone()

        # Find where the position resets to 0 (indicating a new sequence)
        seq_starts = torch.cat([torch.tensor([True], dtype=torch.bool, device=device), adjusted_row[1:] == 0])
        # Get the indices where the sequence starts
        start_indices = torch.cat([
            torch.nonzero(seq_starts).unbind(dim=1)[0],
            torch.tensor([len(adjusted_row)], dtype=torch.int32, device=device),
        ])
        # Calculate the sequence lengths
        seq_lengths = start_indices[1:] - start_indices[:-1]
        # Calculate the cumulative sequence lengths
        cu_seqlens = torch.cat([torch.tensor([0], dtype=torch.int32, device=device), seq_lengths.cumsum(0)])
        # Append the padding length to the cumulative sequence lengths
        if padding_length:
            cu_seqlens = torch.cat([cu_seqlens, torch.tensor([len(row)], dtype=torch.int32, device=device)])
        max_seq_len = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
        results.append(cu_seqlens)
        max_seq_lens.append(max_seq_len)

    # Find the maximum value across all tensors
    max_value = max(t.max() for t in results)

    # Find the length of the longest tensor
    max_length = max(t.size(0) for t in results)

    # Pad each tensor to the same length and collect them in a list
    padded_results = [F.pad(t, (0, max_length - t.size(0)), "constant", max_value) for t in results]

    return torch.stack(padded_results).to(dtype=torch.int32), torch.stack(max_seq_lens)


def update_ring_attn_params(batch):
    input_ids = batch["input_ids"]
    position_ids = batch.get("position_ids")
    if position_ids is None:
        seq_len = input_ids.shape[1]
        position_ids = torch.arange(0, seq_len, dtype=torch.long, device=input_ids.device).unsqueeze(0)

    cu_seqlens, _ = get_cu_seqlens_from_pos_ids(position_ids)
    cu_seqlens = cu_seqlens.squeeze()
    update_ring_flash_attn_params(cu_seqlens, get_ring_attn_group())


def adjust_position_ids_for_slice(position_ids, start_idx):
    """
    Adjust position IDs for a sliced sequence to maintain proper relative positions.
    This handles the case where position IDs might not be contiguous due to sample
    packing.
    """
    # Find the boundaries between samples (where position_ids reset)
    adjusted_pos_ids = position_ids.clone()

    # Process each sequence in the batch
    for i in range(position_ids.shape[0]):
        seq = position_ids[i]

        # Find sample boundaries
        boundaries = []
        for j in range(1, len(seq)):
            if seq[j] < seq[j - 1]:
                boundaries.append(j)

        # No need to adjust if there are no boundaries or this is a single sample
        if not boundaries:
            adjusted_pos_ids[i] = seq - start_idx
            continue

        # Adjust each segment separately
        prev_boundary = 0
        for boundary in boundaries:
            adjusted_pos_ids[i, prev_boundary:boundary] -= start_idx
            prev_boundary = boundary

        # Last segment
        adjusted_pos_ids[i, prev_boundary:] -= start_idx

    return adjusted_pos_ids


class _Tokenizer:
    # the part of the tokenizer DataCollatorForSeq2Seq uses: right padding to a multiple
    padding_side = "right"
    pad_token_id = 0

    def pad(self, features, padding=True, max_length=None, pad_to_multiple_of=None, return_tensors="pt"):
        length = max(len(f["input_ids"]) for f in features)
        if pad_to_multiple_of:
            length = (length + pad_to_multiple_of - 1) // pad_to_multiple_of * pad_to_multiple_of
        out = {}
        for key, value in (("input_ids", self.pad_token_id), ("attention_mask", 0), ("labels", -100),
                           ("position_ids", 0)):
            if key in features[0]:
                rows = [list(f[key]) + [value] * (length - len(f[key])) for f in features]
                out[key] = torch.tensor(rows, dtype=torch.long)
        return out


@dataclass
class DataCollatorForSeq2Seq:
    tokenizer: Any
    model: Optional[Any] = None
    padding: Any = True
    max_length: Optional[int] = None
    pad_to_multiple_of: Optional[int] = None
    label_pad_token_id: int = -100
    position_pad_token_id: int = 0
    return_tensors: str = "pt"
    sequence_parallel_degree: int = 1

    def __post_init__(self):
        if self.sequence_parallel_degree > 1:
            # Get information about our position in the SP group
            sp_group = get_ring_attn_group()
            self.local_rank = dist.get_rank(group=sp_group)
            self.local_world_size = dist.get_world_size(group=sp_group)

    def __call__(self, features, return_tensors=None):
        has_attn_mask = "attention_mask" in features[0].keys()
        if return_tensors is None:
            return_tensors = self.return_tensors

        for feature_name, pad_token_id in [("labels", self.label_pad_token_id),
                                           ("position_ids", self.position_pad_token_id)]:
            feat = [feature[feature_name] for feature in features] if feature_name in features[0].keys() else None
            if feat is not None:
                max_feature_length = max(len(l) for l in feat)  # noqa: E741
                if self.pad_to_multiple_of is not None:
                    max_feature_length = ((max_feature_length + self.pad_to_multiple_of - 1)
                                          // self.pad_to_multiple_of * self.pad_to_multiple_of)
                padding_side = self.tokenizer.padding_side
                for feature in features:
                    remainder = [pad_token_id] * (max_feature_length - len(feature[feature_name]))
                    if padding_side == "right":
                        feature[feature_name] = np.concatenate([feature[feature_name], remainder]).astype(np.int64)
                    else:
                        feature[feature_name] = np.concatenate([remainder, feature[feature_name]]).astype(np.int64)

        features = self.tokenizer.pad(features, padding=self.padding, max_length=self.max_length,
                                      pad_to_multiple_of=self.pad_to_multiple_of, return_tensors=return_tensors)
        if not has_attn_mask:
            del features["attention_mask"]

        if self.sequence_parallel_degree > 1:
            features = self.apply_sequence_parallelism(features)

        return features

    def apply_sequence_parallelism(self, batch):
        if FIXED:
            # Get local (start, end) for sequence parallelism slicing
            total_seq_len = batch["input_ids"].shape[1]
            slice_size = total_seq_len // self.local_world_size
            start = self.local_rank * slice_size
            end = start + slice_size

            # Update params for ring attention calculation
            update_ring_attn_params(batch=batch)

            # Slice batch for sequence parallel processing
            keys_to_slice = ["input_ids", "attention_mask", "labels", "position_ids"]
            for key in keys_to_slice:
                if key in batch:
                    batch[key] = batch[key][:, start:end]
            return batch

        keys_to_slice = ["input_ids", "attention_mask", "labels", "position_ids"]

        for key in keys_to_slice:
            if key in batch:
                seq_len = batch[key].shape[1]
                slice_size = seq_len // self.local_world_size
                start_idx = self.local_rank * slice_size
                end_idx = (start_idx + slice_size if self.local_rank < self.local_world_size - 1 else seq_len)
                batch[key] = batch[key][:, start_idx:end_idx]

                # Special handling for position_ids
                if key == "position_ids" and self.local_rank > 0:
                    batch[key] = adjust_position_ids_for_slice(batch[key], start_idx)

        return batch


@dataclass
class V2BatchSamplerDataCollatorForSeq2Seq(DataCollatorForSeq2Seq):
    """
    Collator for multipack specific to the using the BatchSampler
    """

    def __call__(self, features, return_tensors=None):
        if not isinstance(features[0], list):
            features = [features]
        out_features = [{} for _ in features]
        for i, features_ in enumerate(features):
            for feature in features_[0].keys():
                if feature == "length":
                    continue
                if feature == "attention_mask":
                    arrays = [(i + 1) * np.array(item[feature]) for i, item in enumerate(features_) if feature in item]
                    out_features[i][feature] = np.concatenate(arrays)
                else:
                    arrays = [np.array(item[feature]) for item in features_ if feature in item]
                    out_features[i][feature] = np.concatenate(arrays)

        return super().__call__(out_features, return_tensors=return_tensors)


class SequenceParallelMixin:
    # core/trainers/mixins/sequence_parallel.py before the fix: the trainer set the ring params each step
    def __init__(self, sequence_parallel_degree):
        self.sequence_parallel_degree = sequence_parallel_degree
        self.ring_attn_group = get_ring_attn_group()

    def _update_ring_flash_attn_params(self, inputs):
        # At this point, inputs should already be partitioned by the sequence
        # parallel data collator
        batch_size = inputs["input_ids"].shape[0]
        seq_len = inputs["input_ids"].shape[1]
        packed_seq_lens = [seq_len] * batch_size

        # Calculate the full sequence length across all GPUs in this SP group
        total_seq_len = seq_len * self.sequence_parallel_degree

        cu_seqlens = torch.cumsum(torch.tensor(packed_seq_lens, dtype=torch.int32), dim=-1, dtype=torch.int32)
        cu_seqlens = F.pad(F.pad(cu_seqlens, (1, 0), value=0), (0, 1), value=total_seq_len)

        update_ring_flash_attn_params(cu_seqlens, self.ring_attn_group)

    def training_step(self, model, inputs):
        if not FIXED and self.sequence_parallel_degree > 1:
            self._update_ring_flash_attn_params(inputs)
        with torch.no_grad():
            return model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]).logits


# ---- one multipack step on SEQUENCE_PARALLEL_DEGREE ranks -------------------------------------------------------------
RING_ATTN_GROUP = _ThreadGroup(SEQUENCE_PARALLEL_DEGREE)
substitute_hf_flash_attn(process_group=get_ring_attn_group(), heads_k_stride=1)

config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
config._attn_implementation = "ring_attn_varlen_llama3"
model = LlamaForCausalLM(config).eval()

gen = torch.Generator().manual_seed(1)
samples = []
for n in (5, 7, 3):  # three packed samples, padded to sequence_len 16
    ids = torch.randint(3, 96, (n,), generator=gen).tolist()
    samples.append({"input_ids": ids, "attention_mask": [1] * n, "labels": ids, "position_ids": list(range(n))})

logits_by_rank = {}


def run_rank(rank):
    RING_ATTN_GROUP.local.rank = rank
    collator = V2BatchSamplerDataCollatorForSeq2Seq(
        tokenizer=_Tokenizer(), pad_to_multiple_of=16, return_tensors="pt",
        sequence_parallel_degree=SEQUENCE_PARALLEL_DEGREE)
    batch = collator([dict(s) for s in samples])
    trainer = SequenceParallelMixin(SEQUENCE_PARALLEL_DEGREE)
    logits_by_rank[rank] = (trainer.training_step(model, batch), batch["labels"])


threads = [threading.Thread(target=run_rank, args=(r,)) for r in range(SEQUENCE_PARALLEL_DEGREE)]
for t in threads:
    t.start()
for t in threads:
    t.join()

logits = torch.cat([logits_by_rank[r][0] for r in range(SEQUENCE_PARALLEL_DEGREE)], dim=1)
labels = torch.cat([logits_by_rank[r][1] for r in range(SEQUENCE_PARALLEL_DEGREE)], dim=1)
shift_labels = labels[:, 1:].clone()
starts = np.cumsum([0] + [len(s["input_ids"]) for s in samples])[1:-1]
shift_labels[0, starts - 1] = -100  # a sample's last token does not predict the next sample's first
loss = F.cross_entropy(logits[0, :-1], shift_labels[0], ignore_index=-100)
print("packed multipack loss over %d ranks: %.6f" % (SEQUENCE_PARALLEL_DEGREE, loss.item()))
print("last-token argmax per sample:", [int(logits[0, e - 1].argmax()) for e in np.cumsum([len(s["input_ids"])
                                                                                              for s in samples])])
