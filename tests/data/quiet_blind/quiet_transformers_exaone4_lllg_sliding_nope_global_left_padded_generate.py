# Citation: huggingface/transformers src/transformers/models/exaone4/modeling_exaone4.py
#   @948448a0267c036370ef15663ac42dc15fbfa682 (Exaone4Model.forward builds causal_mask_mapping with
#   create_causal_mask / create_sliding_window_causal_mask, each decoder layer takes the one for its layer_types entry;
#   Exaone4Attention applies RoPE only on sliding layers, the global layer is NoPE) and configuration_exaone4.py
#   (sliding_window_pattern=4 -> "LLLG").
# Masking: three local layers see the last sliding_window=3 tokens, the fourth layer sees the whole causal prefix; a
#   left-padded batch (attention_mask 0 on the pads, position_ids from the mask's cumsum) keeps the pads out of both
#   kinds of layer, in the prefill forward and in generate() with its DynamicCache.
# Self-check: each row's real-position logits and its greedy continuation equal the same prompt run alone, unpadded,
#   with no attention_mask.
import torch
from transformers import Exaone4Config, Exaone4ForCausalLM

torch.manual_seed(0)
config = Exaone4Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                       sliding_window=3, sliding_window_pattern=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
config._attn_implementation = "eager"
assert config.layer_types == ["sliding_attention"] * 3 + ["full_attention"], config.layer_types
model = Exaone4ForCausalLM(config).eval()

prompts = [torch.randint(3, 96, (n,)).tolist() for n in (9, 5, 7)]
L = max(len(p) for p in prompts)
input_ids = torch.zeros(len(prompts), L, dtype=torch.long)
attention_mask = torch.zeros(len(prompts), L, dtype=torch.long)
for i, p in enumerate(prompts):  # left padding, as for generation
    input_ids[i, L - len(p):] = torch.tensor(p)
    attention_mask[i, L - len(p):] = 1
position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

with torch.no_grad():
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    gen = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False,
                         pad_token_id=0, eos_token_id=None)

    for i, p in enumerate(prompts):
        alone = torch.tensor([p])
        ref_logits = model(input_ids=alone).logits[0]
        got = logits[i, L - len(p):]
        assert torch.allclose(got, ref_logits, atol=1e-5), (i, (got - ref_logits).abs().max())
        ref_gen = model.generate(input_ids=alone, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)
        assert gen[i, L:].tolist() == ref_gen[0, len(p):].tolist(), (i, gen[i, L:], ref_gen[0, len(p):])
print("ok: exaone4 LLLG sliding/global left-padded prefill logits and greedy generate match per-prompt runs")
