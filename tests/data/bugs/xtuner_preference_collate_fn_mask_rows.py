"""xtuner preference_collate_fn fills the attention mask by batch rows, not by each sample's length.

Citation: InternLM/xtuner#859 ("[Bug] fix preference_collate_fn attn_mask", commit 9444b3423d3f, 2024-07-22),
file xtuner/dataset/collate_fns/preference_collate_fn.py. Diff of the non-varlen branch:

    -        for i in ori_length:
    -            attention_mask[:i] = True
    +        for i, length in enumerate(ori_length):
    +            attention_mask[i, :length] = True

Bug: the DPO/ORPO collator splits each pair into a chosen and a rejected row, right-pads them with
pad_sequence, and must build the padding mask from the original lengths (the comment says the pad id can
equal eos, so the ids cannot be used). `attention_mask[:i] = True` slices the *batch* axis: every row
whose index is below some length becomes all True, so padding positions are marked as real tokens and
the policy / reference forward attends to the pad tokens. Fix: set row i up to its own length.

Reproduction: the collator as xtuner wrote it (sequence-parallel world size 1, no varlen attention),
fed to a tiny random-weight decoder written like transformers' Llama sdpa path (2D padding mask
expanded with the causal mask; no mask and is_causal=True when nothing is padded), called the way
xtuner's DPO model calls its llm (input_ids, attention_mask, position_ids). The rejected answers are shorter than the chosen ones,
so their padded positions attend to pad keys only in the buggy run.
"""
import sys
from typing import Dict, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv

DEFAULT_PAD_TOKEN_INDEX = 0
IGNORE_INDEX = -100


def get_sequence_parallel_world_size():
    return 1


def preference_collate_fn(instances: Sequence[Dict],
                          pad_index: int = DEFAULT_PAD_TOKEN_INDEX,
                          return_hf_format: bool = False,
                          use_varlen_attn: bool = False):
    seq_parallel_world_size = get_sequence_parallel_world_size()
    ds_names = []
    if not use_varlen_attn:
        # split chosen and rejected into two instances
        splited_instances = []
        for d in instances:
            splited_instances.append({
                'input_ids': d['chosen_ids'],
                'labels': d['chosen_labels']
            })
            splited_instances.append({
                'input_ids': d['rejected_ids'],
                'labels': d['rejected_labels']
            })
            ds_names.append(d.get('ds_name', None))
        instances = splited_instances

    input_ids, labels = [], []
    for example in instances:
        input_ids.append(torch.LongTensor(example['input_ids']))
        labels.append(torch.LongTensor(example['labels']))

    ori_length = [len(ids) for ids in input_ids]
    if len(instances) > 1:
        input_ids = pad_sequence(
            input_ids, batch_first=True, padding_value=pad_index)
        labels = pad_sequence(
            labels, batch_first=True, padding_value=IGNORE_INDEX)
    else:
        input_ids = torch.stack(input_ids)
        labels = torch.stack(labels)

    # Some tokenizers have the same eos token and pad token, so input_ids
    # cannot be masked directly based on the pad token id.
    attention_mask = torch.zeros_like(input_ids).bool()
    if FIXED:
        for i, length in enumerate(ori_length):
            attention_mask[i, :length] = True
    else:
        for i in ori_length:
            attention_mask[:i] = True

    bs, seq_len = input_ids.shape
    position_ids = torch.arange(seq_len).unsqueeze(0).long().repeat(bs, 1)
    assert seq_parallel_world_size == 1

    data_dict = {
        'input_ids': input_ids,
        'attention_mask': attention_mask,
        'position_ids': position_ids,
        'labels': labels
    }
    if return_hf_format:
        return data_dict
    return {'data': data_dict, 'data_samples': {'ds_names': ds_names}}


class LlamaSdpaAttention(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        # like transformers' sdpa path: no mask and is_causal when nothing is padded
        is_causal = attention_mask is None and q_len > 1
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=is_causal)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class TinyLlamaForCausalLM(nn.Module):
    """Stand-in for the HF llm xtuner's DPO wraps (embedding, attention layers, lm_head)."""

    def __init__(self, vocab_size=64, hidden_size=32, num_heads=4, num_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.pos = nn.Embedding(128, hidden_size)
        self.layers = nn.ModuleList(LlamaSdpaAttention(hidden_size, num_heads) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        h = self.embed_tokens(input_ids) + self.pos(position_ids)
        seq_len = input_ids.shape[1]
        mask4d = None
        if attention_mask is not None and not attention_mask.all():
            causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
            mask4d = causal[None, None] & attention_mask[:, None, None, :].bool()
        for layer in self.layers:
            h = h + layer(h, mask4d)
        return self.lm_head(h)


def main():
    torch.manual_seed(0)
    llm = TinyLlamaForCausalLM().eval()

    prompt = [1, 11, 12, 13]
    pairs = [
        {'chosen_ids': prompt + [20, 21, 22, 23, 2], 'rejected_ids': prompt + [30, 2]},
        {'chosen_ids': prompt + [24, 25, 2], 'rejected_ids': prompt + [31, 32, 2]},
    ]
    instances = []
    for p in pairs:
        instances.append({
            'chosen_ids': p['chosen_ids'],
            'chosen_labels': [IGNORE_INDEX] * len(prompt) + p['chosen_ids'][len(prompt):],
            'rejected_ids': p['rejected_ids'],
            'rejected_labels': [IGNORE_INDEX] * len(prompt) + p['rejected_ids'][len(prompt):],
        })
    batch = preference_collate_fn(instances)['data']
    with torch.no_grad():
        logits = llm(input_ids=batch['input_ids'], attention_mask=batch['attention_mask'],
                     position_ids=batch['position_ids'])
    print("mask rows", batch['attention_mask'].sum(-1).tolist(), "logit sum", round(float(logits.sum()), 4))


if __name__ == "__main__":
    main()
