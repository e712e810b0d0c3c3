# Follows transformers models/perceiver/modeling_perceiver.py PerceiverModel.forward: attention_mask (1 = real input) is turned
# into an additive bias by invert_attention_mask and used only in the latents->inputs cross-attention (PerceiverAttention with
# is_cross_attention=True); 16 latent queries attend to at most 7 keys, and the latent self-attends use no mask.
import torch
from transformers import PerceiverConfig, PerceiverModel

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
cfg = PerceiverConfig(num_latents=16, d_latents=32, d_model=24, num_blocks=1, num_self_attends_per_block=2,
                      num_self_attention_heads=4, num_cross_attention_heads=2, attention_probs_dropout_prob=0.0)
model = PerceiverModel(cfg).eval().double()
lengths = [7, 2, 5]
T = max(lengths)
inputs = torch.randn(3, T, 24)
attention_mask = torch.zeros(3, T, dtype=torch.long)
for b, L in enumerate(lengths):
    attention_mask[b, T - L:] = 1      # left padding
    inputs[b, :T - L] = 1e3            # pad rows hold junk; the mask must hide them
with torch.no_grad():
    out = model(inputs=inputs, attention_mask=attention_mask).last_hidden_state
    diff = 0.0
    for b, L in enumerate(lengths):
        alone = model(inputs=inputs[b:b + 1, T - L:]).last_hidden_state  # no padding, no mask
        diff = max(diff, (out[b:b + 1] - alone).abs().max().item())
print("latents", tuple(out.shape), "max |left-padded batch - each input set alone| =", diff)
assert diff < 1e-10
