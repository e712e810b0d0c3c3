# Written another way: the bug of 0xallam/Direct-Preference-Optimization#1 (a collator's mask of ones over the prompt
# and zeros over the completion) in a KTO-style trainer whose prompts are LEFT-padded by the tokenizer and whose
# completions are right-padded, a GPT-NeoX policy. Bug: `cat([prompt_attention_mask, zeros_like(completion_ids)])`
# hides every completion token; the fix concatenates the completion's own attention mask.
import sys

import torch
import torch.nn.functional as F
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

FIXED = "--fixed" in sys.argv
PAD = 0


class Tokenizer:
    pad_token_id = PAD

    def __call__(self, seqs, padding_side):
        width = max(map(len, seqs))
        ids, mask = [], []
        for s in seqs:
            pad = [PAD] * (width - len(s))
            ids.append(pad + s if padding_side == "left" else s + pad)
            mask.append([0] * len(pad) + [1] * len(s) if padding_side == "left" else [1] * len(s) + [0] * len(pad))
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


def collate(examples, tokenizer):
    prompt = tokenizer([e["prompt"] for e in examples], padding_side="left")
    completion = tokenizer([e["completion"] for e in examples], padding_side="right")
    completion_mask = completion["attention_mask"] if FIXED else torch.zeros_like(completion["input_ids"])
    return {
        "input_ids": torch.cat([prompt["input_ids"], completion["input_ids"]], dim=1),
        "attention_mask": torch.cat([prompt["attention_mask"], completion_mask], dim=1),
        "completion_start": prompt["input_ids"].shape[1],
        "labels": torch.tensor([e["label"] for e in examples]),
    }


config = GPTNeoXConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=1,
                       eos_token_id=2, attn_implementation="eager")
torch.manual_seed(0)
policy = GPTNeoXForCausalLM(config).eval()

examples = [
    {"prompt": [1, 11, 12, 13], "completion": [21, 22, 23, 24, 2], "label": True},
    {"prompt": [1, 14, 15, 16, 17, 18], "completion": [25, 26, 2], "label": False},
]
batch = collate(examples, Tokenizer())
with torch.no_grad():
    logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
start = batch["completion_start"]
logps = F.log_softmax(logits[:, start - 1:-1], -1).gather(-1, batch["input_ids"][:, start:, None])[..., 0]
weights = (batch["input_ids"][:, start:] != PAD).float()
print("completion log-probs:", [round(v, 4) for v in ((logps * weights).sum(-1)).tolist()])
