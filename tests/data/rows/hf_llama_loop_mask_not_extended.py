"""transformers' LlamaForCausalLM (from its config class, random weights) decoded by a loop written by hand over a
DynamicCache: the prompts left-padded, the model called once a token with the prompt's (2, 5) attention_mask. The loop
never appends a 1 for the token it feeds, so transformers pads the mask with zeros up to the keys and each new token's
own key reads as padding; `--fixed` appends one a step. `--positions` hands cache_position as well. `--zeros`: the
loop appends a 0 a step instead (each token fed marked padding), `--fixed` a 1.
"""
import sys

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
POSITIONS = "--positions" in sys.argv
ZEROS = "--zeros" in sys.argv
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
model = LlamaForCausalLM(config).eval()
ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
mask = (ids != 0).long()
cache = DynamicCache(config=config)
with torch.no_grad():
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    for step in range(3):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        if FIXED:
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        elif ZEROS:
            mask = torch.cat([mask, torch.zeros_like(token)], dim=1)
        more = {"cache_position": torch.tensor([ids.shape[1] + step])} if POSITIONS else {}
        out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True, **more)
print("last logits", [round(x, 4) for x in out.logits[:, -1, :3].flatten().tolist()])
