"""xtuner's SFT collate_fn derived the attention mask from `input_ids != pad_index` with pad == eos.

Citation: InternLM/xtuner PR #567 ("[Fix]Fix attention mask in `default_collate_fn`", commit
899f87d930347323a05edf4cfbea3699bd457666), completed by PR #829 ("[Bugs] Fix dispatch attn
bug", commit 16e2f8f1abc272f2b31ec900f6c94731e20a49d6, "fix collate bug").  Source read:
xtuner/dataset/collate_fns/default_collate_fn.py before 899f87d, at 899f87d and at 16e2f8f.

Bug: `attention_mask = input_ids.ne(pad_index)`.  "Some tokenizers have the same eos token and
pad token" (the fix's comment; e.g. Qwen's <|endoftext|>), and xtuner's chat templates end every
assistant turn with that token, so in a multi-turn sample the real mid-sequence EOS tokens were
masked as if they were padding: later tokens of the same conversation could not attend to them.
Fix: build the mask from the original lengths.  #567 wrote `for i in ori_length:
attention_mask[:i] = True` (indexes batch rows, so every row became all-True, padding
included); #829 corrected it to `attention_mask[i, :length] = True`, which is what `--fixed`
runs.

Reproduction: default_collate_fn (non-varlen path, no sequence parallel) on two tokenized
conversations — a two-turn one (EOS after each answer) and a shorter one-turn one, right-padded
with pad_index == eos_token_id == 2 — feeding a small Qwen2-style causal LM whose
`attention_mask` becomes the usual 4D causal & key-padding mask for SDPA.
"""
import sys
from typing import Dict, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv
IGNORE_INDEX = -100
EOS_TOKEN_ID = 2  # Qwen-style: pad_token == eos_token


def default_collate_fn(instances: Sequence[Dict], pad_index: int = EOS_TOKEN_ID, return_hf_format: bool = False):
    input_ids, labels = [], []
    for example in instances:
        input_ids.append(torch.LongTensor(example['input_ids']))
        labels.append(torch.LongTensor(example['labels']))

    ori_length = [len(ids) for ids in input_ids]
    if len(instances) > 1:
        input_ids = pad_sequence(input_ids, batch_first=True, padding_value=pad_index)
        labels = pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX)
    else:
        input_ids = torch.stack(input_ids)
        labels = torch.stack(labels)

    if FIXED:
        # Some tokenizers have the same eos token and pad token, so input_ids
        # cannot be masked directly based on the pad token id.
        attention_mask = torch.zeros_like(input_ids).bool()
        for i, length in enumerate(ori_length):
            attention_mask[i, :length] = True
    else:
        attention_mask = input_ids.ne(pad_index)
    bs, seq_len = input_ids.shape
    position_ids = torch.arange(seq_len).unsqueeze(0).long().repeat(bs, 1)

    data_dict = {'input_ids': input_ids, 'attention_mask': attention_mask, 'position_ids': position_ids,
                 'labels': labels}
    if return_hf_format:
        return data_dict
    return {'data': data_dict, 'data_samples': None}


class Qwen2Attention(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        split = lambda t: t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        q, k, v = split(self.q_proj(hidden_states)), split(self.k_proj(hidden_states)), split(self.v_proj(hidden_states))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, vocab_size=64, hidden_size=32, num_heads=4, num_layers=2, max_position_embeddings=64):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.embed_positions = nn.Embedding(max_position_embeddings, hidden_size)  # stands in for RoPE
        self.layers = nn.ModuleList([Qwen2Attention(hidden_size, num_heads) for _ in range(num_layers)])
        self.norms = nn.ModuleList([nn.RMSNorm(hidden_size) for _ in range(num_layers)])
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, position_ids, labels):
        seq_len = input_ids.shape[1]
        # 4D mask: causal AND key not padding (True = attend), as _prepare_4d_causal_attention_mask does
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        mask_4d = causal[None, None] & attention_mask[:, None, None, :].bool()
        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        for norm, layer in zip(self.norms, self.layers):
            hidden_states = hidden_states + layer(norm(hidden_states), mask_4d)
        logits = self.lm_head(hidden_states)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)
        return loss, logits


if __name__ == "__main__":
    torch.manual_seed(0)
    # <user> q1 <assistant> a1 <eos> <user> q2 <assistant> a2 <eos>
    two_turn = [10, 11, 12, 20, 21, 2, 10, 13, 12, 22, 23, 2]
    two_turn_labels = [-100, -100, -100, 20, 21, 2, -100, -100, -100, 22, 23, 2]
    one_turn = [10, 14, 12, 24, 2]
    one_turn_labels = [-100, -100, -100, 24, 2]
    batch = default_collate_fn([{'input_ids': two_turn, 'labels': two_turn_labels},
                                {'input_ids': one_turn, 'labels': one_turn_labels}], return_hf_format=True)
    model = Qwen2ForCausalLM().eval()
    with torch.no_grad():
        loss, _ = model(**batch)
    print(f"attention_mask row 0: {batch['attention_mask'][0].int().tolist()}, loss {loss.item():.4f}")
