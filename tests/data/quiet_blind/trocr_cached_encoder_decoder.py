# Follows huggingface/transformers models/trocr/modeling_trocr.py TrOCRForCausalLM (decoder of VisionEncoderDecoderModel):
# causal self-attention mask over text tokens, cross-attention to 4 image-patch states (more queries than keys, no mask),
# and an incremental KV cache. Checked: token-by-token cached decoding equals one full causal forward without cache.
import torch
from transformers import TrOCRConfig, TrOCRForCausalLM
torch.manual_seed(7)
cfg = TrOCRConfig(vocab_size=40, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
                  max_position_embeddings=64, cross_attention_hidden_size=24, use_learned_position_embeddings=True)
model = TrOCRForCausalLM(cfg).double().eval()
enc = torch.randn(1, 4, 24, dtype=torch.float64)        # 4 "patches" from a ViT-like encoder
ids = torch.randint(3, 40, (1, 10))
with torch.no_grad():
    full = model(input_ids=ids, encoder_hidden_states=enc, use_cache=False).logits
    past, steps = None, []
    for t in range(ids.shape[1]):
        o = model(input_ids=ids[:, t:t+1], encoder_hidden_states=enc, past_key_values=past, use_cache=True)
        past = o.past_key_values; steps.append(o.logits)
diff = (torch.cat(steps, 1) - full).abs().max().item()
print("TrOCR cached step-by-step vs full forward max diff", diff)
assert diff < 1e-10
