"""flame's LM collator padded batches but asked the tokenizer for no attention mask.

Citation: fla-org/flame PR #24 ("Data collator fixes", merged as commit 7f8789e).  Source read:
flame/data.py `DataCollatorForLanguageModeling.__call__` at 7f8789e^ and the diff of 7f8789e.
The PR's stated topics are the `add_eos_token` case and EOS labels when pad == eos; the change
of the padded-batch path below is part of the same diff.

Bug: with `varlen=False` and examples of unequal length the collator called
`self.tokenizer.pad(examples, return_tensors='pt', return_attention_mask=False)`, so the batch
carries no `attention_mask`.  The fla attention layer then takes its dense path
(`flash_attn_func(q, k, v, causal=True)`) over the whole padded row; with the Llama/Mistral
tokenizers' left padding every real token of a shorter example attends to the pad tokens in
front of it.
Fix (7f8789e): `return_attention_mask=True` (and an all-ones mask when no padding is needed);
the model then unpads with the mask and runs the varlen kernel per sequence.

Reproduction: the collator on three tokenized documents of 7, 4 and 2 tokens with a left-padding
tokenizer stand-in (pad id 0, HF `pad` semantics), feeding a small fla-style causal LM whose
`Attention.forward` follows fla's branches; `flash_attn_func` / `flash_attn_varlen_func` are
emulated with `F.scaled_dot_product_attention(is_causal=True)` (per segment for varlen).
"""
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class LlamaLikeTokenizer:
    """Stand-in for a Llama/Mistral tokenizer: only what the collator uses (`pad` pads on the left)."""
    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    _pad_token = "<unk>"
    padding_side = "left"
    add_bos_token = True

    def pad(self, examples, return_tensors=None, return_attention_mask=None):
        target = max(e['input_ids'].size(0) for e in examples)
        ids, masks = [], []
        for e in examples:
            n = target - e['input_ids'].size(0)
            ids.append(torch.cat([torch.full((n,), self.pad_token_id, dtype=torch.long), e['input_ids']]))
            masks.append(torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(e['input_ids'].size(0), dtype=torch.long)]))
        batch = {'input_ids': torch.stack(ids)}
        if return_attention_mask is not False:
            batch['attention_mask'] = torch.stack(masks)
        return batch


@dataclass
class DataCollatorForLanguageModeling:
    tokenizer: LlamaLikeTokenizer
    context_len: Optional[int] = None

    def __call__(self, examples: List[Union[List[int], Dict[str, Any]]]) -> Dict[str, Any]:
        if not isinstance(examples[0], Dict):
            examples = [{'input_ids': example} for example in examples]
        examples = [{'input_ids': torch.tensor(e['input_ids'], dtype=torch.long)} for e in examples]

        # (the varlen=True branch, cu_seqlens from BOS/EOS, is left out: this bug is in the padded path)
        length_of_first = examples[0]['input_ids'].size(0)
        if FIXED:
            needs_padding = not all(example['input_ids'].size(0) == length_of_first for example in examples)
            if needs_padding:
                if self.tokenizer.pad_token_id is None:
                    raise ValueError('You are attempting to pad samples but the tokenizer has no pad token.')
                batch = self.tokenizer.pad(examples, return_tensors='pt', return_attention_mask=True)
            else:
                input_ids = torch.stack([example['input_ids'] for example in examples], dim=0)
                batch = {'input_ids': input_ids, 'attention_mask': torch.ones_like(input_ids)}
            labels = batch['input_ids'].clone()
            if 'attention_mask' in batch:
                labels[batch['attention_mask'] == 0] = -100
            batch['labels'] = labels
            return batch
        # Check if padding is necessary.
        if all(example['input_ids'].size(0) == length_of_first for example in examples):
            batch = {'input_ids': torch.stack([example['input_ids'] for example in examples], dim=0)}
        else:
            # If yes, check if we have a `pad_token`.
            if self.tokenizer._pad_token is None:
                raise ValueError("You are attempting to pad samples but the tokenizer has no pad token.")
            batch = self.tokenizer.pad(examples, return_tensors='pt', return_attention_mask=False)

        labels = batch['input_ids'].clone()
        if self.tokenizer.pad_token_id is not None:
            labels[labels == self.tokenizer.pad_token_id] = -100
        batch["labels"] = labels
        return batch


def unpad_input(hidden_states, attention_mask):
    seqlens = attention_mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return hidden_states.flatten(0, 1)[indices], indices, cu_seqlens, int(seqlens.max())


def pad_input(hidden_states, indices, batch, seqlen):
    out = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype)
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def flash_attn_func(q, k, v, causal=True):
    """(B, T, H, D) dense kernel, emulated with SDPA."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal).transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True):
    """(total, H, D) varlen kernel, emulated with one SDPA call per sequence."""
    o = torch.zeros_like(q)
    for s, e in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
        o[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                                v[s:e].transpose(0, 1), is_causal=causal).transpose(0, 1)
    return o


class Attention(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        batch_size, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(hidden_states).unflatten(-1, (self.num_heads, self.head_dim))
        v = self.v_proj(hidden_states).unflatten(-1, (self.num_heads, self.head_dim))
        if attention_mask is not None:
            q, indices_q, cu_seqlens, max_seqlen = unpad_input(q, attention_mask)
            k, v = k.flatten(0, 1)[indices_q], v.flatten(0, 1)[indices_q]
            o = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                       max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, causal=True)
            o = pad_input(o, indices_q, batch_size, q_len)
        else:
            o = flash_attn_func(q, k, v, causal=True)
        return self.o_proj(o.flatten(-2))


class TransformerForCausalLM(nn.Module):
    def __init__(self, vocab_size=64, hidden_size=32, num_heads=4, num_hidden_layers=2):
        super().__init__()
        self.embeddings = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList([Attention(hidden_size, num_heads) for _ in range(num_hidden_layers)])
        self.norms = nn.ModuleList([nn.RMSNorm(hidden_size) for _ in range(num_hidden_layers)])
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        hidden_states = self.embeddings(input_ids)
        for norm, layer in zip(self.norms, self.layers):
            hidden_states = hidden_states + layer(norm(hidden_states), attention_mask=attention_mask)
        logits = self.lm_head(hidden_states)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return loss, logits


if __name__ == "__main__":
    torch.manual_seed(0)
    collator = DataCollatorForLanguageModeling(LlamaLikeTokenizer())
    batch = collator([[1, 17, 23, 9, 41, 5, 2], [1, 33, 12, 2], [1, 2]])
    model = TransformerForCausalLM().eval()
    with torch.no_grad():
        loss, _ = model(**batch)
    print(f"keys {sorted(batch)}, loss {loss.item():.4f}")
