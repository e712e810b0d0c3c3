# Citation: huggingface/transformers src/transformers/models/llama/modeling_llama.py (LlamaModel.forward -> create_causal_mask),
#   src/transformers/masking_utils.py (sdpa_mask, padding_mask_function), src/transformers/cache_utils.py StaticCache,
#   src/transformers/generation/utils.py (cache_implementation="static")
# Left-padded prompts are decoded with a fixed-size StaticCache; every step builds a causal mask over all cache slots
# AND the running 2-D attention_mask (0/1 ints, extended by one 1 per step), so pads and unwritten slots are never seen.
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     attn_implementation="sdpa")
model = LlamaForCausalLM(config).eval()

prompts = [[1, 17, 33, 54, 9, 71], [1, 88, 5], [1, 40, 41, 42, 43]]
max_len = max(len(p) for p in prompts)
input_ids = torch.tensor([[0] * (max_len - len(p)) + p for p in prompts])  # left padding
attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])

with torch.no_grad():
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False,
                         cache_implementation="static", pad_token_id=0)
print("generated", out[:, max_len:].tolist())
