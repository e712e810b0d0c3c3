# Follows transformers src/transformers/models/mistral/modeling_mistral.py (create_sliding_window_causal_mask)
# and tests/models/mistral/test_modeling_mistral.py sliding-window generation: window=4, so once the sequence
# is longer than 4 each query sees only its last 4 keys; cached greedy decoding must match a no-cache forward.
import torch
from transformers import MistralConfig, MistralForCausalLM

torch.manual_seed(1)
cfg = MistralConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                    max_position_embeddings=64, pad_token_id=0, eos_token_id=None, bos_token_id=None)
model = MistralForCausalLM(cfg).double().eval()
model.generation_config.eos_token_id = None
model.generation_config.pad_token_id = 0

prompt = torch.randint(1, 101, (1, 6))
new = 14  # total 20 tokens, far past the window
worst = 0.0
for impl in ("sdpa", "eager"):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        seq = out.sequences
        step_logits = torch.stack(out.logits, 1)[0]               # (new, V)
        full = model(seq, use_cache=False).logits[0]             # no cache, whole sequence
        ref = full[prompt.shape[1] - 1: seq.shape[1] - 1]
    d = (step_logits - ref).abs().max().item()
    assert d == d, "NaN"
    worst = max(worst, d)

# explicit per-query reference for the window: token t only needs tokens t-3..t
model.set_attn_implementation("eager")
with torch.no_grad():
    t = seq.shape[1] - 1
    # With 2 layers the receptive field is 2*(4-1) tokens back, so a 7-token suffix must reproduce the last logit
    # only if positions are kept: pass the true position_ids of the suffix.
    suffix = seq[:, t - 6:t + 1]
    pos = torch.arange(t - 6, t + 1).unsqueeze(0)
    local = model(suffix, position_ids=pos, use_cache=False).logits[0, -1]
    worst = max(worst, (local - full[t]).abs().max().item())
print(f"max |cached generate - no-cache forward / windowed suffix| = {worst:.3e}")
assert worst < 1e-6  # generate() returns logits as float32
