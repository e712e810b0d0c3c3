# 360-LLaMA-Factory (Qihoo360/360-LLaMA-Factory commit 797b1490 "sft checked; multiple fixes"): SFT with sequence
# parallelism in 'zigzag-ring' mode pads every example to cutoff_len and splits it zigzag (rank r keeps chunks r and
# 2*world-1-r), then ring-flash-attn's zigzag_ring_flash_attn_func attends across ranks. Before the fix
# preprocess_supervised_dataset emitted no position_ids and SFTDataCollatorWith4DAttentionMask passed none, so each
# rank's model numbered its local zigzag shard 0..L/world-1: the rotary positions of queries and of the keys that
# arrive from other ranks no longer match their places in the sequence. The fix emits position_ids (padded with
# cutoff_len - 1), zigzag-splits them with the rest, and keeps them in the batch (require_position_ids).
# Ranks are threads here; ring_flash_attn's zigzag forward is ported over a plain-torch flash forward, with the ring
# send/recv done between the threads. The SP loss reduction added by the same commit is used in both runs.
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

IGNORE_INDEX = -100
SEQUENCE_PARALLEL_SIZE = 2
CUTOFF_LEN = 16


# ---- torch.distributed stand-in: the sequence-parallel group's ranks are threads ------------------------------------
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


dist = _ThreadDist()


# ---- ring_flash_attn: utils.py (RingComm, update_out_and_lse) and zigzag_ring_flash_attn.py -------------------------
class RingComm:
    def __init__(self, process_group):
        self._process_group = process_group
        self.rank = dist.get_rank(self._process_group)
        self.world_size = dist.get_world_size(self._process_group)
        self.send_rank = (self.rank + 1) % self.world_size
        self.recv_rank = (self.rank - 1) % self.world_size
        self._pending = []

    def send_recv(self, to_send):
        self._pending.append(to_send)
        return len(self._pending) - 1

    def commit(self):
        group = self._process_group
        group.slots[self.rank] = [t.clone() for t in self._pending]
        group.barrier.wait()
        self._received = [t.clone() for t in group.slots[self.recv_rank]]
        group.barrier.wait()

    def wait(self):
        received, self._pending = self._received, []
        return received


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal):
    # flash_attn kernel on [b, s, h, d]: returns out [b, s, h, d] and softmax_lse [b, h, s]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * softmax_scale
    if causal:
        allowed = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), v.float())
    return out.to(q.dtype), lse


def _update_out_and_lse(out, lse, block_out, block_lse):
    block_out = block_out.to(torch.float32)
    block_lse = block_lse.transpose(-2, -1).unsqueeze(dim=-1)
    out = out - F.sigmoid(block_lse - lse) * (out - block_out)
    lse = lse - F.logsigmoid(lse - block_lse)
    return out, lse


def update_out_and_lse(out, lse, block_out, block_lse, slice_=None):
    if out is None:
        if slice_ is not None:
            raise RuntimeError("first update_out_and_lse should not pass slice_ args")
        out = block_out.to(torch.float32)
        lse = block_lse.transpose(-2, -1).unsqueeze(dim=-1)
    elif slice_ is not None:
        slice_out, slice_lse = out[slice_], lse[slice_]
        slice_out, slice_lse = _update_out_and_lse(slice_out, slice_lse, block_out, block_lse)
        out[slice_], lse[slice_] = slice_out, slice_lse
    else:
        out, lse = _update_out_and_lse(out, lse, block_out, block_lse)
    return out, lse


def zigzag_ring_flash_attn_forward(process_group, q, k, v, softmax_scale, dropout_p=0, causal=True):
    assert causal is True, "zigzag ring is meaningless for causal=False"
    comm = RingComm(process_group)

    block_seq_len = q.shape[1] // 2
    q1 = q[:, block_seq_len:]

    out = None
    lse = None
    next_k, next_v = None, None

    def forward(q, k, v, causal):
        block_out, block_lse = _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal=causal)
        return block_out, block_lse

    for step in range(comm.world_size):
        if step + 1 != comm.world_size:
            comm.send_recv(k)
            comm.send_recv(v)
            comm.commit()

        if step == 0:
            block_out, block_lse = forward(q, k, v, causal=True)
            out, lse = update_out_and_lse(out, lse, block_out, block_lse)
        elif step <= comm.rank:
            k0 = k[:, :block_seq_len]
            v0 = v[:, :block_seq_len]
            block_out, block_lse = forward(q, k0, v0, causal=False)
            out, lse = update_out_and_lse(out, lse, block_out, block_lse)
        else:
            block_out, block_lse = forward(q1, k, v, causal=False)
            out, lse = update_out_and_lse(out, lse, block_out, block_lse,
                                          slice_=(slice(None), slice(block_seq_len, None)))

        if step + 1 != comm.world_size:
            next_k, next_v = comm.wait()
            k = next_k
            v = next_v

    out = out.to(q.dtype)
    lse = lse.squeeze(dim=-1).transpose(1, 2)
    return out, lse


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, group=None):
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    out, _ = zigzag_ring_flash_attn_forward(group, q, k, v, softmax_scale, dropout_p=dropout_p, causal=causal)
    return out


# ---- 360-LLaMA-Factory: model/model_utils/sequence_parallel.py ------------------------------------------------------
def new_flash_attn_forward(query_states, key_states, value_states, attention_mask, q_len, dropout=0,
                           sliding_window=None, is_causal=True, group=None, **kwargs):
    attn_output = zigzag_ring_flash_attn_func(query_states, key_states, value_states, dropout, causal=is_causal,
                                              group=group)

    return attn_output


def apply_sequence_parallel(sequence_parallel_size):
    group_this = _ThreadGroup(sequence_parallel_size)
    _flash_attention_forward = partial(new_flash_attn_forward, group=group_this)

    # transformers' integrations/flash_attention.py flash_attention_forward, calling the patched
    # modeling_flash_attention_utils._flash_attention_forward
    def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                sliding_window=None, softcap=None, **kwargs):
        seq_len = query.shape[2]
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        attn_output = _flash_attention_forward(query, key, value, attention_mask, seq_len, dropout=dropout,
                                               softmax_scale=scaling, sliding_window=sliding_window,
                                               is_causal=module.is_causal, **kwargs)
        return attn_output, None

    AttentionInterface.register("zigzag_ring_sp", flash_attention_forward)
    AttentionMaskInterface.register("zigzag_ring_sp", flash_attention_mask)
    return group_this


# ---- 360-LLaMA-Factory: data/processors/supervised.py, data/data_utils.py, data/loader.py, data/collator.py --------
def preprocess_supervised_dataset(examples: Dict[str, List[Any]]) -> Dict[str, List[Any]]:
    # inputs `<bos> X Y <eos>`, labels `<ignore> ... <ignore> Y <eos>` (tokenized already here)
    model_inputs = defaultdict(list)
    for prompt_ids, response_ids in zip(examples["_prompt"], examples["_response"]):
        input_ids = prompt_ids + response_ids
        labels = [IGNORE_INDEX] * len(prompt_ids) + response_ids
        model_inputs["input_ids"].append(input_ids)
        model_inputs["attention_mask"].append([1] * len(input_ids))
        if FIXED:
            model_inputs["position_ids"].append(list(range(len(input_ids))))
        model_inputs["labels"].append(labels)
    return model_inputs


def preprocess_sp_dataset(seq_ids, world_size, sequence_parallel_mode):
    if sequence_parallel_mode == "zigzag-ring":
        step = len(seq_ids) // (2 * world_size)
        value_chunks = [seq_ids[s: s + step] for s in range(0, len(seq_ids), step)]
        local_values = list()
        for rank in range(world_size):
            local_values.append(value_chunks[rank] + value_chunks[2 * world_size - rank - 1])
        return local_values
    else:
        raise NotImplementedError("Other sequence parallel modes are to be implemented.")


def sequence_parallel_processor(dataset, pad_token_id_input, sequence_parallel_size, sequence_parallel_mode):
    def pad_sequence(examples):
        max_length = CUTOFF_LEN
        input_pad_token_id = pad_token_id_input
        label_pad_token_id = IGNORE_INDEX

        for k, v in examples.items():
            if k.endswith("input_ids"):
                pad_token_id = input_pad_token_id
            elif k.endswith("labels"):
                pad_token_id = label_pad_token_id
                # shift labels here
                v = [seq[1:] for seq in v]
            elif k.endswith("attention_mask"):
                pad_token_id = 0
            elif k.endswith("position_ids"):
                pad_token_id = max_length - 1  # pad the max position id
            else:
                raise NotImplementedError(f"Unexpected dataset key: {k}")
            examples[k] = [seq + [pad_token_id] * (max_length - len(seq)) for seq in v]

        return examples

    # sp for Sequence Parallel
    def sp_split(examples):
        for k, v in examples.items():
            chunks = list()
            for row in v:
                if row is None:
                    chunks += [None] * sequence_parallel_size
                else:
                    chunks += preprocess_sp_dataset(row, sequence_parallel_size, sequence_parallel_mode)
            examples[k] = chunks
        return examples

    return sp_split(pad_sequence(dict(dataset)))


@dataclass
class SFTDataCollatorWith4DAttentionMask:
    require_position_ids: bool = False

    def __call__(self, features):
        if not self.require_position_ids:
            features = [{k: v for k, v in d.items() if k != "position_ids"} for d in features]
        return {k: torch.tensor([f[k] for f in features]) for k in features[0]}


# ---- one SFT step on SEQUENCE_PARALLEL_SIZE ranks ------------------------------------------------------------------
sp_group = apply_sequence_parallel(SEQUENCE_PARALLEL_SIZE)

config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, max_position_embeddings=64, use_cache=False, pad_token_id=0,
                     initializer_range=0.3)
config._attn_implementation = "zigzag_ring_sp"
model = LlamaForCausalLM(config).eval()

gen = torch.Generator().manual_seed(1)
prompt = torch.randint(3, 96, (6,), generator=gen).tolist()
response = torch.randint(3, 96, (7,), generator=gen).tolist()
examples = {"_prompt": [prompt], "_response": [response]}
dataset = sequence_parallel_processor(preprocess_supervised_dataset(examples), config.pad_token_id,
                                      SEQUENCE_PARALLEL_SIZE, "zigzag-ring")
# SequentialSampler: the SP group's ranks take consecutive rows of the split dataset
rows = [{k: dataset[k][r] for k in dataset} for r in range(SEQUENCE_PARALLEL_SIZE)]

# run_sft: require_position_ids was added to the collator by the fix
collator = SFTDataCollatorWith4DAttentionMask(require_position_ids=FIXED and SEQUENCE_PARALLEL_SIZE > 1)
results = {}


def run_rank(rank):
    sp_group.local.rank = rank
    inputs = collator([rows[rank]])
    labels = inputs.pop("labels")
    with torch.no_grad():
        logits = model(**inputs).logits
    # CustomSeq2SeqTrainer.compute_loss with sequence parallel: labels already shifted, summed then reduced
    loss_sum = F.cross_entropy(logits.view(-1, config.vocab_size), labels.view(-1), reduction="sum")
    results[rank] = (loss_sum, (labels != IGNORE_INDEX).sum(), logits)


threads = [threading.Thread(target=run_rank, args=(r,)) for r in range(SEQUENCE_PARALLEL_SIZE)]
for t in threads:
    t.start()
for t in threads:
    t.join()

loss = sum(results[r][0] for r in results) / sum(results[r][1] for r in results)
print("zigzag-ring SP sft loss: %.6f" % loss.item())
print("argmax per rank:", [results[r][2][0].argmax(-1).tolist() for r in range(SEQUENCE_PARALLEL_SIZE)])
