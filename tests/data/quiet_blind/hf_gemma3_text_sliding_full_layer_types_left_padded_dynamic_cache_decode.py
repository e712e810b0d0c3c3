"""Gemma3 text model (transformers, from Gemma3TextConfig): 5 local : 1 global layers, left-padded decode.

Follows huggingface/transformers src/transformers/models/gemma3/modeling_gemma3.py
(Gemma3TextModel.forward builds a mask mapping {"full_attention": create_causal_mask,
"sliding_attention": create_sliding_window_causal_mask} and each decoder layer picks its own by
config.layer_types; local layers use rope_local_base_freq) and the generate() conventions in
src/transformers/generation/utils.py (left padding, position_ids = attention_mask.cumsum(-1) - 1 with
pads set to 1, attention_mask grown by one column each step, DynamicCache). The loop here is
written out by hand with teacher-forced next tokens. sliding_window=3 with prompts up to 7 long so
the window matters; attn_implementation="sdpa". Reference: each row alone, unpadded, full sequence, no cache; logits on real
positions must agree at every step.
"""
import torch
from transformers import Gemma3TextConfig, Gemma3ForCausalLM, DynamicCache

torch.manual_seed(0)
cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=3,
                       max_position_embeddings=64, query_pre_attn_scalar=16, pad_token_id=0,
                       attn_implementation="sdpa")
assert cfg.layer_types.count("full_attention") == 1
model = Gemma3ForCausalLM(cfg).double().eval()

prompts = [torch.randint(1, 64, (n,)) for n in (7, 2, 5)]
fed = torch.randint(1, 64, (len(prompts), 3))
B, P = len(prompts), max(len(p) for p in prompts)
ids = torch.zeros(B, P, dtype=torch.long)
am = torch.zeros(B, P, dtype=torch.long)
for i, p in enumerate(prompts):
    ids[i, P - len(p):] = p; am[i, P - len(p):] = 1

with torch.no_grad():
    cache = DynamicCache(config=cfg)
    pos = (am.cumsum(-1) - 1).masked_fill(am == 0, 1)
    out = model(input_ids=ids, attention_mask=am, position_ids=pos, past_key_values=cache, use_cache=True)
    logits = [out.logits]
    for t in range(fed.shape[1]):
        am = torch.cat([am, torch.ones(B, 1, dtype=torch.long)], 1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=fed[:, t:t + 1], attention_mask=am, position_ids=pos, past_key_values=out.past_key_values,
                    cache_position=torch.tensor([am.shape[1] - 1]), use_cache=True)
        logits.append(out.logits)
    batched = torch.cat(logits, 1)
    maxdiff = 0.0
    for i, p in enumerate(prompts):
        full = torch.cat([p, fed[i]])[None]
        ref = model(input_ids=full).logits[0]
        maxdiff = max(maxdiff, (batched[i, P - len(p):] - ref).abs().max().item())
print("layer_types", cfg.layer_types)
print("max |left-padded cached decode - per-row no-cache logits| =", maxdiff)
assert maxdiff < 1e-10
