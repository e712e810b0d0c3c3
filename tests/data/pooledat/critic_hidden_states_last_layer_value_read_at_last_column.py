"""A PPO critic over a right-padded rollout: values from `hidden_states[-1]` of a causal LM, read at the last column.

The critic is transformers' Llama causal LM (built from its config) asked for its hidden states; its value head is
`head(outputs.hidden_states[-1]) * scale + shift` and the episode's value is read at `[:, -1]`, the last column, which
is padding in every row shorter than the batch. --fixed reads each row at its last real token (`lengths - 1`).
"""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
critic = LlamaForCausalLM(config).eval()
head = torch.nn.Linear(32, 1)
scale, shift = torch.nn.Parameter(torch.tensor(2.0)), torch.nn.Parameter(torch.tensor(0.5))

rollouts = [[1, 5, 6, 7, 8, 9, 2], [1, 10, 11, 2], [1, 12, 13, 14, 2]]
width = max(len(r) for r in rollouts)
ids = torch.tensor([r + [0] * (width - len(r)) for r in rollouts])
mask = (ids != 0).long()
with torch.no_grad():
    outputs = critic(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    values = head(outputs.hidden_states[-1]).squeeze(-1) * scale + shift
    if FIXED:
        episode = values[torch.arange(len(rollouts)), mask.sum(-1) - 1]
    else:
        episode = values[:, -1]
print("episode values:", [round(float(v), 4) for v in episode])
