"""Qwen2 with use_sliding_window: only the layers at or above max_window_layers slide; the lower ones are full.

Follows huggingface/transformers src/transformers/models/qwen2/configuration_qwen2.py (Qwen2Config.__post_init__:
sliding_window kept only if use_sliding_window; layer_types = "sliding_attention" if i >= max_window_layers
else "full_attention") and models/qwen2/modeling_qwen2.py (Qwen2Model.forward builds both
create_causal_mask and create_sliding_window_causal_mask and gives each layer the one its layer_type names),
driven the way generation/utils.py drives it: left-padded prompts, attention_mask extended by one column per
step, position_ids = cumsum(attention_mask) - 1, DynamicCache, greedy.

With num_hidden_layers=4, max_window_layers=2, sliding_window=3 the first two layers see the whole prefix and the
last two only the last 3 positions.  That is what the config says, not a mask mix-up.  Reference: each prompt
alone, unpadded, no cache, full recompute each step.  A second model with use_sliding_window=False (same
weights) must give different logits, so the window really acts.
"""
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

torch.manual_seed(0)
cfg = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, attn_implementation="sdpa")
config = Qwen2Config(use_sliding_window=True, sliding_window=3, max_window_layers=2, **cfg)
assert config.layer_types == ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
model = Qwen2ForCausalLM(config).double().eval()
full = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=False, **cfg)).double().eval()
full.load_state_dict(model.state_dict())

prompts = [[5, 9, 3, 17, 8, 22, 4], [11, 6, 30, 2]]
T, STEPS = max(map(len, prompts)), 5
ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
attn = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])

with torch.no_grad():
    cache = DynamicCache(config=config)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for step in range(STEPS):
        nxt = logits[-1].argmax(-1, keepdim=True)
        attn = torch.cat([attn, torch.ones(2, 1, dtype=attn.dtype)], 1)
        pos = attn.sum(-1, keepdim=True) - 1
        out = model(input_ids=nxt, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    got = torch.stack(logits, 1)

    max_diff, window_effect = 0.0, 0.0
    for b, p in enumerate(prompts):
        seq = torch.tensor([p])
        for step in range(STEPS + 1):
            ref = model(input_ids=seq, use_cache=False).logits[:, -1]
            max_diff = max(max_diff, (got[b, step] - ref[0]).abs().max().item())
            window_effect = max(window_effect, (full(input_ids=seq, use_cache=False).logits[:, -1] - ref)
                                .abs().max().item())
            seq = torch.cat([seq, ref.argmax(-1, keepdim=True)], 1)

print("layer_types:", config.layer_types)
print("max |left-padded cached batch - single uncached|:", max_diff)
print("max |sliding config - all-full config| (must be > 0):", window_effect)
assert max_diff < 1e-10 and window_effect > 1e-6
