"""A numpy collator that fills its attention_mask by columns for every row: the longest sample's length wins.

Written apart from xtuner#829 (`attention_mask[:i] = True`, a torch collator, LlamaForCausalLM): a
Lightning-style `collate` in numpy that pads four samples on the right with id 0, a GPT-2 (transformers'
GPT2LMHeadModel, eager, whose config states no pad id) handed the batch as a dict of tensors. Bug:
`mask[:, :len(sample)] = 1` writes the sample's columns into every row, so after the loop every row is all ones up
to the longest sample and the padded positions of the shorter rows are read as text. Fix: `mask[row, :len(sample)]`.
"""
import sys

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv
PAD = 0


def collate(samples):
    width = max(len(s) for s in samples)
    ids = np.full((len(samples), width), PAD, dtype=np.int64)
    mask = np.zeros((len(samples), width), dtype=np.int64)
    for row, sample in enumerate(samples):
        ids[row, : len(sample)] = sample
        if FIXED:
            mask[row, : len(sample)] = 1
        else:
            mask[:, : len(sample)] = 1
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}


config = GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=2, n_head=2)
config._attn_implementation = "eager"
model = GPT2LMHeadModel(config).eval()
rng = np.random.default_rng(0)
samples = [rng.integers(1, 40, n).tolist() for n in (6, 3, 9, 4)]
batch = collate(samples)
with torch.no_grad():
    logits = model(**batch).logits
print("mask rows", batch["attention_mask"].sum(-1).tolist(), "logits", tuple(logits.shape))
