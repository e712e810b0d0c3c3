# Citation: huggingface/transformers src/transformers/generation/utils.py (GenerationMixin._assisted_decoding) and
#   src/transformers/generation/candidate_generator.py (AssistedCandidateGenerator), src/transformers/models/llama/
#   modeling_llama.py (create_causal_mask with past_key_values).
# Masking: a small draft model proposes up to 4 tokens; the target verifies them in one forward over its KV cache
#   with a causal mask offset by the cache length (each candidate sees the cache and earlier candidates only);
#   rejected candidates are cropped from both caches before the next round. Greedy, so the output must equal plain
#   greedy decoding of the target, which the program checks.
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)


def cfg(layers, hidden):
    c = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
    c._attn_implementation = "eager"
    return c


target = LlamaForCausalLM(cfg(2, 32)).eval()
draft = LlamaForCausalLM(cfg(1, 16)).eval()
draft.generation_config.num_assistant_tokens = 4
draft.generation_config.num_assistant_tokens_schedule = "constant"

prompt = torch.randint(3, 64, (1, 7))
am = torch.ones_like(prompt)
with torch.no_grad():
    spec = target.generate(input_ids=prompt, attention_mask=am, assistant_model=draft, max_new_tokens=10,
                           do_sample=False, pad_token_id=0)
    ref = target.generate(input_ids=prompt, attention_mask=am, max_new_tokens=10, do_sample=False, pad_token_id=0)
assert torch.equal(spec, ref), (spec, ref)
print(f"assisted == greedy: {spec[0, 7:].tolist()}")
