"""A linear probe over a middle layer: each row's state read one row at a time at its last slot, right-padded.

A probing loop feeds a right-padded batch of sentences to a causal LM (transformers' Llama, built from its config)
with output_hidden_states, takes layer 1's states, and for each sentence reads `layer[i]` and then `[-1]`: the last
column, a pad slot of every sentence shorter than the batch's longest. --fixed reads each row at its last real token
(`attention_mask[i].sum() - 1`). Self-check of the fix: every sentence's probe feature matches the sentence run alone.
"""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                     num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
model = LlamaForCausalLM(config).eval()
sentences = [[1, 5, 6, 7, 8, 9], [1, 10, 11], [1, 12, 13, 14]]
width = max(len(s) for s in sentences)
ids = torch.tensor([s + [0] * (width - len(s)) for s in sentences])
mask = (ids != 0).long()
with torch.no_grad():
    layer = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[1]
    features = []
    for i in range(len(sentences)):
        row = layer[i]
        features.append(row[int(mask[i].sum()) - 1] if FIXED else row[-1])
    alone = [model(input_ids=torch.tensor([s]), output_hidden_states=True).hidden_states[1][0, -1] for s in sentences]
print("probe features match each sentence alone:", all(torch.allclose(f, a, atol=1e-5) for f, a in zip(features, alone)))
