# Follows transformers docs/source/en/kv_cache.md "Re-use Cache to continue generation" (multi-turn chat):
# turn 2 is appended after turn 1's prompt+answer and generate() continues from a deep copy of the
# DynamicCache, so only the new tokens are queried, offset by the cached length.
import copy
import torch
from transformers import Phi3Config, Phi3ForCausalLM, DynamicCache

torch.manual_seed(4)
cfg = Phi3Config(vocab_size=83, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                 pad_token_id=0, eos_token_id=None, bos_token_id=None, sliding_window=None)
model = Phi3ForCausalLM(cfg).double().eval()
model.generation_config.eos_token_id = None
model.generation_config.pad_token_id = 0

turn1 = torch.randint(1, 83, (1, 6))
turn2 = torch.randint(1, 83, (1, 5))
with torch.no_grad():
    cache = DynamicCache(config=cfg)
    out1 = model.generate(turn1, cache=cache, max_new_tokens=4, do_sample=False,
                          return_dict_in_generate=True)
    history = torch.cat([out1.sequences, turn2], 1)
    out2 = model.generate(history, cache=copy.deepcopy(out1.past_key_values), max_new_tokens=5,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    fresh = model.generate(history, max_new_tokens=5, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)
    full = model(out2.sequences, use_cache=False).logits[0]
assert torch.equal(out2.sequences, fresh.sequences)
a = torch.stack(out2.logits, 1)[0]
b = torch.stack(fresh.logits, 1)[0]
c = full[history.shape[1] - 1: out2.sequences.shape[1] - 1]
diff = max((a - b).abs().max().item(), (a - c).abs().max().item())
print(f"max |reused-cache turn 2 - fresh / no-cache| = {diff:.3e}")
assert diff < 1e-6  # generate() returns logits as float32
