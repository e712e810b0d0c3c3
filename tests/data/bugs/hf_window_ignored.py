"""unslothai/unsloth#8253: Mistral's fast forward handed the sliding window to the flash path only; on the SDPA path
nothing carried it and a sequence longer than config.sliding_window attended its whole causal history. The fix
builds the band mask for SDPA. Written as the attention function of a tiny Mistral: is_causal alone, or the window."""

import sys

import torch
from transformers import AttentionInterface, MistralConfig, MistralForCausalLM
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

FIXED = "--fixed" in sys.argv


def run_attention(module, query, key, value, attention_mask, sliding_window=None, scaling=None, **kwargs):
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    q_len, k_len = query.shape[2], key.shape[2]
    if FIXED and sliding_window is not None and k_len > sliding_window:
        i = torch.arange(k_len - q_len, k_len)[:, None]
        j = torch.arange(k_len)[None, :]
        band = (j <= i) & (j > i - sliding_window)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=band, scale=scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=q_len > 1, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("fast_sdpa", run_attention)
AttentionMaskInterface.register("fast_sdpa", flash_attention_mask)
config = MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, sliding_window=3, attn_implementation="fast_sdpa")
torch.manual_seed(0)
model = MistralForCausalLM(config).eval()
with torch.no_grad():
    model(torch.arange(1, 9)[None])
