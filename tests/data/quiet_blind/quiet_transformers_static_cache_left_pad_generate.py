# Citation: huggingface/transformers src/transformers/generation/utils.py (GenerationMixin.generate with
#   cache_implementation="static") + src/transformers/masking_utils.py (create_causal_mask / sdpa_mask with
#   padding_mask_function) + src/transformers/models/llama/modeling_llama.py (LlamaAttention, sdpa backend).
# LLM inference with a preallocated StaticCache and a LEFT-padded batch: every step's mask spans the whole static cache
# (max_cache_len columns); keys are kept iff causal (kv <= cache_position) and not a left-pad position per the 2-D
# attention_mask, which generate extends by one 1 per decoded token; unwritten cache slots are beyond the causal edge.
# Position ids come from attention_mask.cumsum - 1 so left padding does not shift RoPE. Checked against unpadded runs.
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     pad_token_id=0, bos_token_id=1, eos_token_id=127)
config._attn_implementation = "sdpa"
model = LlamaForCausalLM(config).eval()

prompts = [torch.randint(2, 127, (n,)) for n in (9, 5, 2)]
L = max(len(p) for p in prompts)
input_ids = torch.full((len(prompts), L), config.pad_token_id, dtype=torch.long)
attention_mask = torch.zeros((len(prompts), L), dtype=torch.long)
for i, p in enumerate(prompts):  # tokenizer.padding_side = "left"
    input_ids[i, L - len(p):] = p
    attention_mask[i, L - len(p):] = 1

gen_kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=config.pad_token_id)
with torch.no_grad():
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, cache_implementation="static",
                         **gen_kwargs)
    new = out[:, L:]
    # the most-padded row alone (no padding) must produce the same greedy continuation
    same = []
    for i, p in list(enumerate(prompts))[-1:]:
        ref = model.generate(input_ids=p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             cache_implementation="static", **gen_kwargs)[:, len(p):]
        same.append(bool(torch.equal(ref[0], new[i])))
print("new tokens:", new.tolist(), "match unpadded:", same)
