"""transformers#39408: flash attention was given window_size=(sliding_window, sliding_window), so with causal=True a
query sees sliding_window + 1 keys (flash_attn's window_size=(left, right) counts keys besides the query itself).
The fix passes (sliding_window - 1, sliding_window - 1). Written here as a registered attention function that builds
flash_attn's window_size mask itself and runs it through SDPA (flash_attn needs a GPU)."""

import sys

import torch
from transformers import AttentionInterface, MistralConfig, MistralForCausalLM
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

FIXED = "--fixed" in sys.argv


def flash_like_attention(module, query, key, value, attention_mask, sliding_window=None, scaling=None, dropout=0.0, **kwargs):
    if sliding_window:
        window_size = (sliding_window - 1, sliding_window - 1) if FIXED else (sliding_window, sliding_window)
    else:
        window_size = (-1, -1)
    q_len, k_len = query.shape[2], key.shape[2]
    i = torch.arange(k_len - q_len, k_len)[:, None]  # causal=True: bottom-right, as flash_attn aligns it
    j = torch.arange(k_len)[None, :]
    keep = j <= i
    if window_size[0] >= 0:
        keep = keep & (j >= i - window_size[0])
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=keep, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("window_size_sdpa", flash_like_attention)
AttentionMaskInterface.register("window_size_sdpa", flash_attention_mask)
config = MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, sliding_window=3, attn_implementation="window_size_sdpa")
torch.manual_seed(0)
model = MistralForCausalLM(config).eval()
with torch.no_grad():
    model(torch.arange(1, 9)[None])
