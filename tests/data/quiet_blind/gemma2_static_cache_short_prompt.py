# Follows transformers tests/utils/test_cache_utils.py (StaticCache with Gemma2Config) and docs kv_cache.md:
# a StaticCache of 32 slots holds a 5-token prompt; the unfilled slots are masked via cache_position, and
# Gemma2's alternating sliding (window 4) / global layers must match a full no-cache forward.
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, StaticCache

torch.manual_seed(3)
cfg = Gemma2Config(vocab_size=73, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                   max_position_embeddings=64, pad_token_id=0, attn_implementation="eager")
model = Gemma2ForCausalLM(cfg).double().eval()

prompt = torch.randint(1, 73, (1, 5))
cache = StaticCache(config=cfg, max_cache_len=32)
seq = prompt
step_logits = []
with torch.no_grad():
    cp = torch.arange(prompt.shape[1])
    out = model(prompt, cache=cache, cache_position=cp, use_cache=True)
    step_logits.append(out.logits[0, -1])
    for _ in range(12):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
        cp = torch.tensor([seq.shape[1] - 1])
        out = model(nxt, cache=cache, cache_position=cp, use_cache=True)
        step_logits.append(out.logits[0, -1])
    full = model(seq, use_cache=False).logits[0]
cached = torch.stack(step_logits)
ref = full[prompt.shape[1] - 1:]
diff = (cached - ref).abs().max().item()
print(f"max |StaticCache decode - no-cache forward| = {diff:.3e}")
assert torch.equal(cached.argmax(-1), ref.argmax(-1))
assert diff < 1e-6  # eager softmax runs in float32 even for a float64 model
