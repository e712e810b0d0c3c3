"""transformers Mllama: text-to-image cross-attention is silently causal under SDPA.

Citation: huggingface/transformers issue #48172 "[Mllama] MllamaVisionAttention and
MllamaTextCrossAttention never set self.is_causal — cross-attention is silently causal under sdpa"
(closed), fix proposed in PR #48218 (closed when read; `--fixed` applies its change).

Bug (from the issue): `MllamaTextCrossAttention` never sets `self.is_causal`, and
`integrations/sdpa_attention.py` resolves the flag as `getattr(module, "is_causal", True)`; with no 4-D
mask (`cross_attention_mask` omitted) SDPA is called with `is_causal=True`. For a cross-attention the
query axis is text tokens and the key axis is vision tokens, so SDPA's top-left causal mask lets text
token i see only vision tokens 0..i of the image.

Fix (PR #48218): set `self.is_causal = False` on `MllamaVisionAttention` and
`MllamaTextCrossAttention`, as CLIP / SigLIP / Qwen2-VL vision attention do.

This program runs the installed transformers `MllamaTextCrossAttention` class (5.24, which still has
the missing flag), built from an `MllamaTextConfig` with random weights and
`_attn_implementation="sdpa"`: a batch of 2 captions of 6 tokens attends to 10 vision tokens with no
`cross_attention_mask`. `--fixed` sets `is_causal = False` on the module as the PR does.
"""
import sys

import torch
from transformers.models.mllama.configuration_mllama import MllamaTextConfig
from transformers.models.mllama.modeling_mllama import MllamaTextCrossAttention

FIXED = "--fixed" in sys.argv


def main():
    torch.manual_seed(0)
    config = MllamaTextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        num_hidden_layers=2, cross_attention_layers=[1], vocab_size=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )
    config._attn_implementation = "sdpa"
    cross_attn = MllamaTextCrossAttention(config, layer_idx=1).eval()
    if FIXED:
        cross_attn.is_causal = False
    text_hidden_states = torch.randn(2, 6, config.hidden_size)
    cross_attention_states = torch.randn(2, 10, config.hidden_size)  # projected vision tokens
    with torch.no_grad():
        out, _ = cross_attn(text_hidden_states, cross_attention_states=cross_attention_states, attention_mask=None)
    print("fixed" if FIXED else "buggy", "cross-attn out sum", round(out.sum().item(), 4))


if __name__ == "__main__":
    main()
