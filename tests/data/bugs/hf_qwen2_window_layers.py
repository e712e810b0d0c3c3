"""transformers#35924 / #35896, fixed by #36162: after the attention refactor Qwen2 applied config.sliding_window to
every layer, not only to the layers max_window_layers leaves sliding (layer_types). Written as the attention function
of a tiny Qwen2 that reads the window from the config (the bug) or from the layer's own sliding_window (the fix)."""

import sys

import torch
from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

FIXED = "--fixed" in sys.argv


def attention(module, query, key, value, attention_mask, sliding_window=None, scaling=None, **kwargs):
    if not FIXED and module.config.use_sliding_window:
        sliding_window = module.config.sliding_window
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    q_len, k_len = query.shape[2], key.shape[2]
    i = torch.arange(k_len - q_len, k_len)[:, None]
    j = torch.arange(k_len)[None, :]
    keep = j <= i
    if sliding_window is not None:
        keep = keep & (j > i - sliding_window)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=keep, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("qwen_sdpa", attention)
AttentionMaskInterface.register("qwen_sdpa", flash_attention_mask)
config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, use_sliding_window=True, sliding_window=3, max_window_layers=1,
                     attn_implementation="qwen_sdpa")
torch.manual_seed(0)
model = Qwen2ForCausalLM(config).eval()
with torch.no_grad():
    model(torch.arange(1, 9)[None])
