"""A reward model over GPT-2 (learned absolute positions, `wpe`) scoring prompts one at a time, each left-padded to a
fixed window of 10 with its attention_mask, and handed no position_ids: GPT-2 numbers the columns, so a prompt's
first token sits at its pad count, and the same text is embedded by how much padding its window needed. The fix
(--fixed) hands position_ids from the mask (cumsum - 1), as generate does. Another model passed as an argument
(`llama`, rotary positions: a row shifted whole is the same text) is quiet either way. Written for
tests/test_checks_positioned.py."""
import sys

import torch
from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

if "llama" in sys.argv:
    model = LlamaModel(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)).eval()
else:
    model = GPT2Model(GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=32, pad_token_id=0)).eval()
head = torch.nn.Linear(32, 1)
window = 10
prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15, 16, 17]]
with torch.no_grad():
    for prompt in prompts:
        pad = window - len(prompt)
        ids = torch.tensor([[0] * pad + prompt])
        mask = torch.tensor([[0] * pad + [1] * len(prompt)])
        extra = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)} if FIXED else {}
        hidden = model(input_ids=ids, attention_mask=mask, **extra).last_hidden_state
        print(prompt, round(head(hidden[0, -1]).item(), 5))
