# Citation: NVIDIA/NeMo PR #14437 "Fix sequence packing loss calculation" (NVIDIA-NeMo/Speech#14437,
#   commit 7a5026b76de4183145bea82c0032dad2b80492b2; buggy code read at 7a5026b76d^).
# Upstream: nemo/collections/nlp/data/language_modeling/megatron/gpt_sft_dataset.py
#   GPTSFTPackedDataset.collate_fn (cu_seqlens / cu_seqlens_unpadded), nemo/utils/sequence_packing_utils.py
#   fill_packing_strategy, and MegatronGPTModel.get_forward_output_and_loss_func, which hands
#   PackedSeqParams(cu_seqlens_q=cu_seqlens_unpadded, cu_seqlens_q_padded=cu_seqlens, qkv_format='thd')
#   to TEDotProductAttention.
# Bug: collate_fn took each packed sequence's real (unpadded) length from the FIRST eos_id in it
#   (`eos_idx[0][0] + 1`). With chat data whose turns end in the tokenizer's EOS, the first EOS is the end
#   of the user turn, so cu_seqlens_unpadded cut every sequence after its first turn: the THD kernel treats
#   the assistant tokens as padding between sequences (not attended to, attention output left at zero).
# Fix: `seqlen_unpadded = eos_idx[0][1] + 1 if eos_idx[0].shape[0] > 1 else len(current_seq)` (the same
#   commit also stops dropping pad-id tokens from the answer_start_idx loss mask in fill_packing_strategy).
import math
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
np.random.seed(0)

BOS_ID, EOS_ID, VOCAB = 1, 2, 48


class TinyTokenizer:
    eos_id = EOS_ID
    bos_id = BOS_ID


# ---------------------------------------------------------------- nemo/utils/sequence_packing_utils.py
def create_hist(dataset, truncate_seq_len: int):
    sequences = {i: [] for i in range(truncate_seq_len + 1)}
    for item in dataset:
        seq_len = len(item["input_ids"]) - 1
        sequences[seq_len].append(item)
    histogram = [len(sequences[i]) for i in range(truncate_seq_len + 1)]
    return sequences, histogram


def first_fit(seqlens: List[int], pack_size: int) -> List[List[int]]:
    res, sum_of_res = [], []
    for s in seqlens:
        first_bin = next((i for i in range(len(res)) if sum_of_res[i] + s <= pack_size), -1)
        if first_bin == -1:
            res.append([s])
            sum_of_res.append(s)
        else:
            res[first_bin].append(s)
            sum_of_res[first_bin] += s
    return res


def first_fit_decreasing(seqlens: List[int], pack_size: int) -> List[List[int]]:
    return first_fit(sorted(seqlens, reverse=True), pack_size)


def create_packing_strategy(histogram: List[int], pack_size: int):
    all_seq_lens = []
    for i, count in enumerate(histogram):
        all_seq_lens.extend([i] * count)
    assignments = first_fit_decreasing(all_seq_lens, pack_size)
    packed_seq_lens = [sum(x) for x in assignments]
    packing_metadata = {"dataset_max_seqlen": max(all_seq_lens), "max_samples_per_bin": max(len(b) for b in assignments)}
    return assignments, packing_metadata


def fill_packing_strategy(assignments, sequences: Dict[int, List[Dict]], pack_size: int, pad_id: int):
    ifile_handles = dict()
    for seq_len in range(pack_size + 1):
        per_seq_data = sequences[seq_len]
        if len(per_seq_data) > 0:
            perm = np.random.permutation(len(per_seq_data))
            input_ids = [per_seq_data[p]["input_ids"] for p in perm]
            try:
                loss_mask = [per_seq_data[p]["loss_mask"] for p in perm]
                # roll loss mask by 1 to align with labels. We want to train on the output after the last context token
                loss_mask = [x[1:] + [False] for x in loss_mask]
            except KeyError:
                loss_mask = [
                    [
                        (idx >= (x["answer_start_idx"] - 1))
                        if FIXED
                        else (idx >= (x["answer_start_idx"] - 1) and x["input_ids"][idx] != pad_id)
                        for idx in range(len(x["input_ids"]))
                    ]
                    for x in [per_seq_data[p] for p in perm]
                ]
            ifile_handles[seq_len] = (input_ids, loss_mask)

    input_ids, loss_mask, seq_start_id = {}, {}, {}
    for oindex, assignment in enumerate(assignments):
        _input_ids, _loss_mask, _seq_start_id = [], [], [0]
        for seq_length in assignment:
            _input_ids.extend(ifile_handles[seq_length][0].pop())
            _loss_mask.extend(ifile_handles[seq_length][1].pop())
            _seq_start_id.append(len(_input_ids))
        input_ids[oindex] = _input_ids
        loss_mask[oindex] = _loss_mask
        seq_start_id[oindex] = _seq_start_id[:-1]

    return [
        {"input_ids": input_ids[i], "loss_mask": loss_mask[i], "seq_start_id": seq_start_id[i]}
        for i in range(len(input_ids))
    ]


# ---------------------------------------------------------------- gpt_sft_dataset.py GPTSFTPackedDataset
class GPTSFTPackedDataset:
    def __init__(self, packed_data, pack_metadata, tokenizer, max_seq_length, pad_seq_length_to_mult=16,
                 answer_only_loss=True, return_cu_seqlen=True, pad_to_max_length=False, pad_cu_seqlens=False):
        self.indexed_dataset = packed_data
        self.pack_metadata = pack_metadata
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.pad_seq_length_to_mult = pad_seq_length_to_mult
        self.answer_only_loss = answer_only_loss
        self.return_cu_seqlen = return_cu_seqlen
        self.pad_to_max_length = pad_to_max_length
        self.pad_cu_seqlens = pad_cu_seqlens
        self.samples_mapping = None

    def __len__(self):
        return len(self.indexed_dataset)

    def __getitem__(self, idx):
        input_ids = self.indexed_dataset[idx]["input_ids"]
        seq_boundaries = self.indexed_dataset[idx]["seq_start_id"] + [len(input_ids)]
        loss_mask = self.indexed_dataset[idx]["loss_mask"]
        return {"input_ids": input_ids, "seq_boundaries": seq_boundaries, "loss_mask": loss_mask}

    def _ceil_to_nearest(self, n, m):
        return (n + m - 1) // m * m

    def _maybe_cast_to_list(self, x):
        return [item.tolist() if isinstance(item, np.ndarray) else item for item in x]

    def _collate_item(self, item, max_length, pad_id):
        item = self._maybe_cast_to_list(item)
        return [x + [pad_id] * (max_length - len(x)) for x in item]

    def _build_loss_mask(self, processed_example):
        seq_boundaries = processed_example["seq_boundaries"]
        if self.answer_only_loss:
            return np.concatenate(
                [
                    processed_example["loss_mask"][seq_boundaries[i] : seq_boundaries[i + 1] - 1]
                    for i in range(len(seq_boundaries) - 1)
                ]
            )
        return np.concatenate(
            [
                [
                    0 if x == self.tokenizer.eos_id else 1.0
                    for x in processed_example["input_ids"][seq_boundaries[i] : seq_boundaries[i + 1] - 1]
                ]
                for i in range(len(seq_boundaries) - 1)
            ]
        )

    def collate_fn(self, batch):
        input_ids = [
            np.concatenate(
                [
                    item["input_ids"][item["seq_boundaries"][i] : item["seq_boundaries"][i + 1] - 1]
                    for i in range(len(item["seq_boundaries"]) - 1)
                ]
            )
            for item in batch
        ]
        labels = [
            np.concatenate(
                [
                    item["input_ids"][item["seq_boundaries"][i] + 1 : item["seq_boundaries"][i + 1]]
                    for i in range(len(item["seq_boundaries"]) - 1)
                ]
            )
            for item in batch
        ]
        loss_mask = [self._build_loss_mask(item) for item in batch]
        token_count = [item.shape[0] for item in input_ids]

        if self.pad_to_max_length:
            max_length = self.max_seq_length
        else:
            max_length = max(len(l) for l in input_ids)
            max_length = min(self.max_seq_length, self._ceil_to_nearest(max_length, self.pad_seq_length_to_mult))
        assert max_length <= self.max_seq_length

        position_ids: List[List[int]] = []
        cu_seqlens: List[List[int]] = []
        cu_seqlens_unpadded: List[List[int]] = []
        for item in batch:
            position_ids.append([])
            cu_seqlens.append([0])
            cu_seqlens_unpadded.append([0])
            seqlens = np.array(item["seq_boundaries"][1:]) - np.array(item["seq_boundaries"][:-1])
            for l in seqlens:
                # length minus 1 because input_ids is truncated by 1 for labels
                position_ids[-1].extend(list(range(l - 1)))
                cu_seqlens[-1].append(cu_seqlens[-1][-1] + l - 1)

            assert cu_seqlens[-1][-1] <= max_length
            # since data is prepadded when cp_size > 1, there may be some extra padding at the end
            # of the packed sequence. In this case, we need to add the max seq len to the end.
            if cu_seqlens[-1][-1] != max_length:
                cu_seqlens[-1].append(max_length)

            for i in range(len(item["seq_boundaries"]) - 1):
                current_seq = item["input_ids"][item["seq_boundaries"][i] : item["seq_boundaries"][i + 1] - 1]
                # since the data could be prepadded with tokenizer's eos_id, we can find out the index of all the eos_id
                eos_idx = np.where(np.array(current_seq) == self.tokenizer.eos_id)
                # The second eos_id index marks the length of the original unpadded sequence if the sequence is
                # prepadded for cp_size > 1. Otherwise, there is no extra padding.
                if FIXED:
                    seqlen_unpadded = eos_idx[0][1] + 1 if eos_idx[0].shape[0] > 1 else len(current_seq)
                else:
                    seqlen_unpadded = eos_idx[0][0] + 1 if eos_idx[0].any() else len(current_seq)
                cu_seqlens_unpadded[-1].append(cu_seqlens_unpadded[-1][-1] + int(seqlen_unpadded))

            # if extra paddings are added in the packed sequence, they can't be counted as
            # actual tokens for training
            if len(cu_seqlens[-1]) > len(cu_seqlens_unpadded[-1]):
                cu_seqlens_unpadded[-1].append(cu_seqlens_unpadded[-1][-1])

        input_ids = self._collate_item(input_ids, max_length=max_length, pad_id=self.tokenizer.eos_id)
        labels = self._collate_item(labels, max_length=max_length, pad_id=self.tokenizer.eos_id)
        loss_mask = self._collate_item(loss_mask, max_length=max_length, pad_id=0)
        position_ids = self._collate_item(position_ids, max_length=max_length, pad_id=0)

        processed_batch = {
            "tokens": torch.LongTensor(input_ids),
            "labels": torch.LongTensor(labels),
            "loss_mask": torch.LongTensor(loss_mask),
            "position_ids": torch.LongTensor(position_ids),
            "token_count": token_count,
        }
        cu_seqlens = self._collate_item(cu_seqlens, max_length=max(len(l) for l in cu_seqlens) + 1, pad_id=-1)
        cu_seqlens_unpadded = self._collate_item(
            cu_seqlens_unpadded, max_length=max(len(l) for l in cu_seqlens_unpadded) + 1, pad_id=-1
        )
        cu_seqlens = torch.IntTensor(cu_seqlens)
        cu_seqlens_argmin = torch.argmin(cu_seqlens, dim=1, keepdim=True)
        seqlens = cu_seqlens[:, 1:] - cu_seqlens[:, :-1]
        max_seqlen, _ = seqlens.max(dim=1, keepdim=True)
        cu_seqlens_unpadded = torch.IntTensor(cu_seqlens_unpadded)
        cu_seqlens_unpadded_argmin = torch.argmin(cu_seqlens_unpadded, dim=1, keepdim=True)
        processed_batch.update(
            {
                "attention_mask": torch.LongTensor([1] * len(input_ids)),  # no attention mask is needed for packed seq
                "cu_seqlens": cu_seqlens,
                "cu_seqlens_argmin": cu_seqlens_argmin,
                "max_seqlen": max_seqlen,
                "cu_seqlens_unpadded": cu_seqlens_unpadded,
                "cu_seqlens_unpadded_argmin": cu_seqlens_unpadded_argmin,
            }
        )
        return processed_batch


# ---------------------------------------------------------------- megatron.core PackedSeqParams + TE stand-in
@dataclass
class PackedSeqParams:
    qkv_format: str = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_kv: torch.Tensor = None
    cu_seqlens_q_padded: torch.Tensor = None
    cu_seqlens_kv_padded: torch.Tensor = None
    max_seqlen_q: torch.Tensor = None
    max_seqlen_kv: torch.Tensor = None


def fused_attn_thd_padding_causal(q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                                  softmax_scale):
    """Plain-torch stand-in for TE's THD fused attention, attn_mask_type='padding_causal'.
    Sequence i occupies [cu_seqlens_*_padded[i], cu_seqlens_*_padded[i+1]) of the token axis; only its first
    cu_seqlens_*[i+1]-cu_seqlens_*[i] tokens are real; the rest are padding (not attended, output zero)."""
    out = torch.zeros_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        qs = int(cu_seqlens_q_padded[i])
        ks = int(cu_seqlens_kv_padded[i])
        nq = int(cu_seqlens_q[i + 1] - cu_seqlens_q[i])
        nk = int(cu_seqlens_kv[i + 1] - cu_seqlens_kv[i])
        if nq == 0 or nk == 0:
            continue
        qi = q[qs : qs + nq].transpose(0, 1)  # [h, nq, d]
        ki = k[ks : ks + nk].transpose(0, 1)
        vi = v[ks : ks + nk].transpose(0, 1)
        scores = torch.matmul(qi, ki.transpose(-1, -2)) * softmax_scale
        causal = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=nk - nq)
        scores = scores.masked_fill(~causal, float("-inf"))
        out[qs : qs + nq] = torch.matmul(scores.softmax(-1), vi).transpose(0, 1)
    return out


def _rope_thd(t, cu_seqlens, inv_freq):
    # megatron rope_utils._apply_rotary_pos_emb_thd: positions restart at 0 in every packed sequence
    out = torch.empty_like(t)
    for i in range(cu_seqlens.numel() - 1):
        s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        pos = torch.arange(e - s, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        x = t[s:e]
        x1, x2 = x.chunk(2, dim=-1)
        out[s:e] = x * emb.cos() + torch.cat([-x2, x1], dim=-1) * emb.sin()
    return out


class TEDotProductAttention(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        self.softmax_scale = 1.0 / math.sqrt(head_dim)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, packed_seq_params=None):
        p = packed_seq_params
        return fused_attn_thd_padding_causal(
            query, key, value, p.cu_seqlens_q, p.cu_seqlens_kv,
            p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q,
            p.cu_seqlens_kv_padded if p.cu_seqlens_kv_padded is not None else p.cu_seqlens_kv,
            self.softmax_scale,
        )


class SelfAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.linear_qkv = nn.Linear(hidden, 3 * hidden)
        self.core_attention = TEDotProductAttention(self.head_dim)
        self.linear_proj = nn.Linear(hidden, hidden)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)))

    def forward(self, hidden_states, attention_mask, packed_seq_params):
        s = hidden_states.shape[0]  # thd: [t, 1, h] -> [t, heads, d]
        q, k, v = self.linear_qkv(hidden_states).squeeze(1).view(s, self.heads, 3 * self.head_dim).chunk(3, dim=-1)
        p = packed_seq_params
        rope_cu = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
        q = _rope_thd(q, rope_cu, self.inv_freq)
        k = _rope_thd(k, rope_cu, self.inv_freq)
        ctx = self.core_attention(q, k, v, attention_mask, packed_seq_params=packed_seq_params)
        return self.linear_proj(ctx.reshape(s, 1, -1))


class TransformerLayer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = SelfAttention(hidden, heads)
        self.pre_mlp_layernorm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x, attention_mask, packed_seq_params):
        x = x + self.self_attention(self.input_layernorm(x), attention_mask, packed_seq_params)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class GPTModel(nn.Module):
    def __init__(self, vocab=VOCAB, hidden=32, heads=4, layers=2):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.decoder = nn.ModuleList([TransformerLayer(hidden, heads) for _ in range(layers)])
        self.final_layernorm = nn.LayerNorm(hidden)
        self.output_layer = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, position_ids, attention_mask, labels=None, packed_seq_params=None):
        x = self.embedding(input_ids).transpose(0, 1).contiguous()  # [s, b, h]
        for layer in self.decoder:
            x = layer(x, attention_mask, packed_seq_params)
        logits = self.output_layer(self.final_layernorm(x)).transpose(0, 1)  # [b, s, v]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none").view_as(labels)


# ---------------------------------------------------------------- MegatronGPTModel.fwd_output_and_loss_func (CP=1)
def fwd_output_and_loss_func(batch, model):
    cu_seqlens_argmin = batch["cu_seqlens_argmin"]
    cu_seqlens_unpadded_argmin = batch["cu_seqlens_unpadded_argmin"]
    max_seqlen = batch["max_seqlen"].squeeze()
    forward_args = {
        "input_ids": batch["tokens"],
        "position_ids": batch["position_ids"],
        "attention_mask": None,  # get_attention_mask_from_fusion
        "labels": batch["labels"],
    }
    cu_seqlens = batch["cu_seqlens"].squeeze()
    cu_seqlens_unpadded = batch["cu_seqlens_unpadded"].squeeze()
    cu_seqlens = cu_seqlens[: cu_seqlens_argmin.item()]
    cu_seqlens_unpadded = cu_seqlens_unpadded[: cu_seqlens_unpadded_argmin.item()]
    forward_args["packed_seq_params"] = PackedSeqParams(
        cu_seqlens_q=cu_seqlens_unpadded,
        cu_seqlens_kv=cu_seqlens_unpadded,
        cu_seqlens_q_padded=cu_seqlens,
        cu_seqlens_kv_padded=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        qkv_format="thd",
    )
    output_tensor = model(**forward_args)
    loss_mask = batch["loss_mask"].float()
    loss = (output_tensor * loss_mask).sum() / loss_mask.sum()
    return loss, forward_args["packed_seq_params"]


# ---------------------------------------------------------------- chat SFT data (GPTSFTChatDataset-style)
def make_chat_example(user, assistant):
    # <bos> user ... <eos> assistant ... <eos>  (the tokenizer's EOS closes every turn)
    input_ids = [BOS_ID] + user + [EOS_ID] + assistant + [EOS_ID]
    loss_mask = [False] * (len(user) + 2) + [True] * (len(assistant) + 1)
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def main():
    g = torch.Generator().manual_seed(1)

    def rand_tokens(n):
        return (torch.randint(3, VOCAB, (n,), generator=g)).tolist()

    chats = [
        make_chat_example(rand_tokens(4), rand_tokens(7)),
        make_chat_example(rand_tokens(3), rand_tokens(6)),
        make_chat_example(rand_tokens(5), rand_tokens(5)),
        make_chat_example(rand_tokens(2), rand_tokens(8)),
    ]
    pack_size = 32
    sequences, histogram = create_hist(chats, pack_size)
    assignments, pack_metadata = create_packing_strategy(histogram, pack_size)
    packed = fill_packing_strategy(assignments, sequences, pack_size, pad_id=TinyTokenizer.eos_id)

    ds = GPTSFTPackedDataset(packed, [pack_metadata], TinyTokenizer(), max_seq_length=pack_size + 16)
    model = GPTModel()
    model.eval()
    torch.manual_seed(0)
    total = []
    with torch.no_grad():
        for idx in range(len(ds)):
            batch = ds.collate_fn([ds[idx]])
            loss, psp = fwd_output_and_loss_func(batch, model)
            print(f"pack {idx}: cu_seqlens={psp.cu_seqlens_q_padded.tolist()} "
                  f"cu_seqlens_unpadded={psp.cu_seqlens_q.tolist()} loss={loss.item():.4f}")
            total.append(loss.item())
    print(f"mean packed SFT loss: {sum(total) / len(total):.4f}")


if __name__ == "__main__":
    main()
