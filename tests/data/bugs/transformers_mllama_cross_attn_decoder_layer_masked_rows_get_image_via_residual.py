# Mllama (Llama 3.2 Vision), huggingface/transformers#39379; fix from PR huggingface/transformers#47103 (closed unmerged; same as Meta llama-models CrossAttention).
# MllamaCrossAttentionDecoderLayer applies full_text_row_masked_out_mask only after the MLP, so text tokens before <|image|> (fully masked
# cross-attention row -> zeroed bias -> uniform attention over the image) still get image content through the gated cross-attention residual.
import sys

import torch

from transformers import MllamaTextConfig
from transformers.models.mllama.modeling_mllama import (
    MllamaCrossAttentionDecoderLayer,
    _prepare_cross_attention_mask,
)

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class PatchedCrossAttentionDecoderLayer(MllamaCrossAttentionDecoderLayer):
    # MllamaCrossAttentionDecoderLayer.forward, as upstream; the fix adds the masking before the attention residual.
    def forward(self, hidden_states, cross_attention_states, cross_attention_mask, attention_mask,
                full_text_row_masked_out_mask, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)

        hidden_states, attn_weights = self.cross_attn(
            hidden_states=hidden_states,
            attention_mask=cross_attention_mask,
            cross_attention_states=cross_attention_states,
            cache=cache,
            **kwargs,
        )
        if FIXED and full_text_row_masked_out_mask is not None:
            hidden_states = full_text_row_masked_out_mask[:, 0] * hidden_states  # type: ignore
        hidden_states = residual + self.cross_attn_attn_gate.tanh() * hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        if full_text_row_masked_out_mask is not None:
            hidden_states = full_text_row_masked_out_mask[:, 0] * hidden_states  # type: ignore
        hidden_states = residual + self.cross_attn_mlp_gate.tanh() * hidden_states

        return hidden_states


config = MllamaTextConfig(
    hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=2, cross_attention_layers=[1], vocab_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
config._attn_implementation = "eager"
layer = PatchedCrossAttentionDecoderLayer(config, layer_idx=1).eval()
with torch.no_grad():  # trained checkpoints have non-zero tanh gates
    layer.cross_attn_attn_gate.fill_(0.7)
    layer.cross_attn_mlp_gate.fill_(0.5)

# Prompt "<text> <text> <text> <|image|> <text> ...": one image with 2 tiles, image token at position 3.
batch, seq_len, num_images, num_tiles, tokens_per_tile = 2, 10, 1, 2, 5
image_token_pos = 3
# dense cross_attention_mask (batch, seq, images, tiles) as MllamaProcessor builds it: 1 from the image token onward
cross_attention_mask = torch.zeros(batch, seq_len, num_images, num_tiles, dtype=torch.long)
cross_attention_mask[:, image_token_pos:, 0, :] = 1

text = torch.randn(batch, seq_len, config.hidden_size)


def run(vision_states):
    mask_4d, full_text_row_masked_out_mask = _prepare_cross_attention_mask(
        cross_attention_mask, num_vision_tokens=tokens_per_tile, dtype=torch.float32
    )
    with torch.no_grad():
        return layer(text, vision_states, mask_4d, None, full_text_row_masked_out_mask)


image_a = torch.randn(batch, num_images * num_tiles * tokens_per_tile, config.hidden_size)
image_b = torch.randn(batch, num_images * num_tiles * tokens_per_tile, config.hidden_size)
out_a, out_b = run(image_a), run(image_b)
# tokens before <|image|> must not depend on the image at all
leak = (out_a[:, :image_token_pos] - out_b[:, :image_token_pos]).abs().max().item()
after = (out_a[:, image_token_pos:] - out_b[:, image_token_pos:]).abs().max().item()
print(f"fixed={FIXED}  max |change| of pre-image text tokens when the image changes: {leak:.6f}")
print(f"(tokens after the image do change: {after:.4f})")
