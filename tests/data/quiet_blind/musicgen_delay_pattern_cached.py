# Follows HF transformers models/musicgen/modeling_musicgen.py: MusicgenForCausalLM.build_delay_pattern_mask /
# apply_delay_pattern_mask (codebook k is shifted right by k; pattern entries != -1 force the pad token, True-ish
# lower/upper triangles) and the decoder's causal mask, run once over the full delayed sequence and once with a cache.
import torch
from transformers import MusicgenDecoderConfig, MusicgenForCausalLM

torch.manual_seed(0)
K, V, T, B = 4, 16, 7, 2
PAD = V                                                # MusicGen uses pad = bos = vocab_size
cfg = MusicgenDecoderConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            ffn_dim=64, num_codebooks=K, max_position_embeddings=64, dropout=0.0,
                            attention_dropout=0.0, activation_dropout=0.0, pad_token_id=PAD,
                            bos_token_id=PAD, layerdrop=0.0)
model = MusicgenForCausalLM(cfg).double().eval()

codes = torch.randint(0, V, (B, K, T))
prompt = torch.cat([torch.full((B, K, 1), PAD), codes], -1).reshape(B * K, T + 1)
S = T + K
ids, pattern = model.build_delay_pattern_mask(prompt, pad_token_id=PAD, max_length=S)
delayed = model.apply_delay_pattern_mask(pattern, pattern)          # the fully specified delayed grid
delayed = delayed.reshape(B, K, S)

# reference 1: delay pattern by an explicit loop
ref = torch.full((B, K, S), PAD)
for b in range(B):
    for k in range(K):
        for t in range(S):
            if 0 <= t - k - 1 < T:
                ref[b, k, t] = codes[b, k, t - k - 1]
d_pattern = (delayed != ref).sum().item()
# and undelaying (MusicGen decode: drop pads, shift codebook k back by k) returns the codes
undelayed = torch.stack([delayed[:, k, k + 1:k + 1 + T] for k in range(K)], 1)
d_pattern += (undelayed != codes).sum().item()

# reference 2: causal decoder, full sequence vs token-by-token with KV cache
inp = delayed.reshape(B * K, S)
with torch.no_grad():
    full = model(input_ids=inp).logits                  # (B, K, S, V) in MusicGen's layout
    past, steps = None, []
    for t in range(S):
        o = model(input_ids=inp[:, t:t + 1], past_key_values=past, use_cache=True)
        past = o.past_key_values
        steps.append(o.logits)
    cached = torch.cat(steps, dim=-2)
d_cache = (full - cached).abs().max().item()
print("delay-pattern mismatches vs explicit loop =", d_pattern)
print("max |full causal logits - cached step logits| =", d_cache)
assert d_pattern == 0 and d_cache < 1e-10
