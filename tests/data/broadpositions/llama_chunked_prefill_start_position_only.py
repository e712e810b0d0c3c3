"""A prompt prefilled in chunks through a tiny Llama, each chunk handed only its first position.

The program feeds a 12-token prompt in chunks of 4 behind a DynamicCache, then decodes greedily. For each chunk it
computes `position_ids = torch.tensor([[start]])`, the position of the chunk's first token (as a decode loop hands its
one token's), where the chunk needs one position a token: Llama's rotary embedding broadcasts the one column over the
chunk's 4 queries and keys, so all four are rotated at `start`. The fix hands `arange(start, start + 4)`.
"""

import sys

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
model = LlamaForCausalLM(config).eval()
prompt = torch.randint(3, 64, (1, 12))
chunk = 4

with torch.no_grad():
    cache = DynamicCache()
    for start in range(0, prompt.shape[1], chunk):
        ids = prompt[:, start:start + chunk]
        position_ids = torch.arange(start, start + ids.shape[1])[None] if FIXED else torch.tensor([[start]])
        out = model(input_ids=ids, position_ids=position_ids, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    tokens = [int(out.logits[0, -1].argmax())]
    for step in range(4):
        position = prompt.shape[1] + step
        out = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[position]]),
                    past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        tokens.append(int(out.logits[0, -1].argmax()))

print("generated:", tokens)
print("last logits:", [round(x, 4) for x in out.logits[0, -1, :4].tolist()])
