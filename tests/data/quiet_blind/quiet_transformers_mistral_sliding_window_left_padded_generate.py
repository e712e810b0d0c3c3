# Citation: huggingface/transformers src/transformers/models/mistral/modeling_mistral.py (MistralModel.forward:
#   create_sliding_window_causal_mask / create_causal_mask mapping; eager_attention_forward adds the mask).
# Masking: config.sliding_window=4 so each query sees itself and the 3 previous real tokens only; left-padded batch
#   (attention_mask 0 on pads) removes padding keys; generate() decodes with a DynamicCache and the same window
#   applied at every step (positions from the cache, padding still masked).
import torch
from transformers import MistralConfig, MistralForCausalLM

torch.manual_seed(0)
config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=4,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
config._attn_implementation = "eager"
model = MistralForCausalLM(config)

# training step on a right-padded batch (labels -100 on padding)
ids = torch.randint(3, 64, (2, 10))
am = torch.ones_like(ids)
am[1, 7:] = 0
ids[1, 7:] = 0
labels = ids.masked_fill(am == 0, -100)
out = model(input_ids=ids, attention_mask=am, labels=labels)
out.loss.backward()

# left-padded generation
model.eval()
prompts = torch.randint(3, 64, (2, 8))
pam = torch.ones_like(prompts)
prompts[1, :3] = 0
pam[1, :3] = 0
with torch.no_grad():
    gen = model.generate(input_ids=prompts, attention_mask=pam, max_new_tokens=6, do_sample=False, pad_token_id=0)
print(f"loss {out.loss.item():.4f} gen {gen[:, 8:].tolist()}")
