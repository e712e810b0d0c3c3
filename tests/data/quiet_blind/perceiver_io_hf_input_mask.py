# Follows huggingface/transformers models/perceiver/modeling_perceiver.py (PerceiverModel.forward):
# attention_mask (1 = keep, right-padded inputs) is turned into an additive bias only for the
# cross-attention from latents to inputs; 8 latents query fewer real inputs, latent self-attention is unmasked.
import torch
from transformers import PerceiverConfig, PerceiverModel
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
cfg = PerceiverConfig(num_latents=8, d_latents=32, d_model=24, num_blocks=1, num_self_attends_per_block=2,
                      num_self_attention_heads=2, num_cross_attention_heads=1, qk_channels=None, v_channels=None,
                      attention_probs_dropout_prob=0.0)
model = PerceiverModel(cfg).eval()
lens = [6, 3]
x = torch.zeros(2, 6, 24)
mask = torch.zeros(2, 6)
seqs = [torch.randn(n, 24) for n in lens]
for b, s in enumerate(seqs):
    x[b, : s.shape[0]] = s; mask[b, : s.shape[0]] = 1
with torch.no_grad():
    out = model(inputs=x, attention_mask=mask).last_hidden_state
    diff = 0.0
    for b, s in enumerate(seqs):
        ref = model(inputs=s[None]).last_hidden_state
        diff = max(diff, (out[b] - ref[0]).abs().max().item())
print("max diff", diff)
assert diff < 1e-6
