# Follows transformers tests/generation/test_utils.py `test_left_padding_compatibility` and the Qwen2 docs:
# prompts of different lengths are LEFT-padded (attention_mask 0 on the left, position ids from cumsum) and
# batched greedy generate must give the same logits as each prompt generated alone without padding.
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

torch.manual_seed(2)
cfg = Qwen2Config(vocab_size=89, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=0, eos_token_id=None, bos_token_id=None)
model = Qwen2ForCausalLM(cfg).double().eval()
model.generation_config.eos_token_id = None
model.generation_config.pad_token_id = 0

prompts = [torch.randint(1, 89, (n,)) for n in (3, 9, 6)]
T = max(len(p) for p in prompts)
ids = torch.zeros(len(prompts), T, dtype=torch.long)
am = torch.zeros(len(prompts), T, dtype=torch.long)
for i, p in enumerate(prompts):
    ids[i, T - len(p):] = p
    am[i, T - len(p):] = 1

worst = 0.0
model.set_attn_implementation("sdpa")  # float64 + eager would softmax in float32: finfo(float64).min -> -inf, NaN pad rows
if True:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=am, max_new_tokens=7, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        batched = torch.stack(out.logits, 1)
        for i, p in enumerate(prompts):
            alone = model.generate(p.unsqueeze(0), max_new_tokens=7, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True)
            assert torch.equal(alone.sequences[0, len(p):], out.sequences[i, T:])
            d = (torch.stack(alone.logits, 1)[0] - batched[i]).abs().max().item()
            assert d == d, "NaN"
            worst = max(worst, d)
print(f"max |left-padded batch - alone| = {worst:.3e}")
assert worst < 1e-6  # generate() returns logits as float32
