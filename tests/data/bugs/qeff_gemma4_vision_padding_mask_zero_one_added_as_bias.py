# quic/efficient-transformers#1159 (commit 0dedfa5b6, "Gemma4 E2B vision and decoder fix", item 3).
# QEffGemma4EncoderWrapper runs Gemma4's vision tower on a max-patch canvas whose padding patches carry position
# (-1, -1). It built the vision attention mask as `(~valid_tokens).to(dtype)`, a 0/1 tensor, and handed it to
# QEffGemma4VisionAttention, whose eager_attention_forward adds the mask to the scores: padding keys got +1 and
# real keys 0, so every real patch of a smaller image attends to the padding patches (slightly favoured).
# The fix builds an additive mask: 0 on valid patches, _attention_mask_min(dtype) on padding patches.
# Ported from QEfficient/transformers/models/gemma4/modeling_gemma4.py with transformers' Gemma4VisionModel built
# from a tiny Gemma4VisionConfig (the wrapper's forward, trimmed of embed_vision and the placeholder slice).
import sys

import torch
import torch.nn as nn
from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4VisionAttention,
    Gemma4VisionModel,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

_FP16_CLAMP_MIN = -65504.0


def _is_onnx_export() -> bool:
    return torch.onnx.is_in_onnx_export()


def _attention_mask_min(dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    # During export with -convert-to-fp16, using finfo(float32).min can create
    # extreme constants that destabilize downstream compiler passes.
    if _is_onnx_export():
        return torch.tensor(_FP16_CLAMP_MIN, dtype=dtype, device=device)
    return torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=device)


def apply_multidimensional_rope(x, cos, sin, position_ids, unsqueeze_dim=2):
    """Applies multidimensional RoPE to inputs (split-free for ndim == 2, as QEff exports it)."""
    ndim = int(position_ids.shape[-1])
    num_input_channels = int(x.shape[-1])
    num_rotated_channels_per_dim = 2 * (num_input_channels // (2 * ndim))
    if ndim == 2:
        c = num_rotated_channels_per_dim
        y0 = apply_rotary_pos_emb(x=x[..., :c], cos=cos[..., :c], sin=sin[..., :c], unsqueeze_dim=unsqueeze_dim)
        y1 = apply_rotary_pos_emb(
            x=x[..., c : 2 * c], cos=cos[..., c : 2 * c], sin=sin[..., c : 2 * c], unsqueeze_dim=unsqueeze_dim
        )
        return torch.cat((y0, y1), dim=-1)
    raise NotImplementedError


class QEffGemma4VisionAttention(Gemma4VisionAttention):
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        cos, sin = position_embeddings

        query_states = self.q_proj(hidden_states).view(hidden_shape)
        query_states = self.q_norm(query_states)
        query_states = apply_multidimensional_rope(query_states, cos, sin, position_ids)
        query_states = query_states.transpose(1, 2)

        key_states = self.k_proj(hidden_states).view(hidden_shape)
        key_states = self.k_norm(key_states)
        key_states = apply_multidimensional_rope(key_states, cos, sin, position_ids)
        key_states = key_states.transpose(1, 2)

        value_states = self.v_proj(hidden_states).view(hidden_shape)
        value_states = self.v_norm(value_states)
        value_states = value_states.transpose(1, 2)

        attn_output, attn_weights = eager_attention_forward(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class QEffGemma4EncoderWrapper(nn.Module):
    def __init__(self, vision_tower):
        super().__init__()
        self.vision_tower = vision_tower

    def forward(self, pixel_values, image_position_ids):
        vision_tower = self.vision_tower
        padding_positions = (image_position_ids == -1).all(dim=-1)
        inputs_embeds = vision_tower.patch_embedder(pixel_values, image_position_ids, padding_positions)

        valid_tokens = ~padding_positions
        if FIXED:
            vision_attention_mask = torch.where(
                valid_tokens.unsqueeze(1).unsqueeze(2),
                torch.zeros((), dtype=inputs_embeds.dtype, device=inputs_embeds.device),
                _attention_mask_min(inputs_embeds.dtype, inputs_embeds.device),
            )
        else:
            vision_attention_mask = (~valid_tokens).unsqueeze(1).unsqueeze(2).to(dtype=inputs_embeds.dtype)
        vision_attention_mask = vision_attention_mask.expand(-1, 1, inputs_embeds.shape[1], -1)

        hidden_states = inputs_embeds
        position_embeddings = vision_tower.encoder.rotary_emb(hidden_states, image_position_ids)
        for layer in vision_tower.encoder.layers[: vision_tower.encoder.config.num_hidden_layers]:
            hidden_states = layer(
                hidden_states,
                attention_mask=vision_attention_mask,
                position_embeddings=position_embeddings,
                position_ids=image_position_ids,
            )

        output_length = pixel_values.shape[-2] // (
            vision_tower.config.pooling_kernel_size * vision_tower.config.pooling_kernel_size
        )
        hidden_states, pooler_mask = vision_tower.pooler(
            hidden_states=hidden_states,
            pixel_position_ids=image_position_ids,
            padding_positions=padding_positions,
            output_length=output_length,
        )
        return hidden_states, pooler_mask


config = Gemma4VisionConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    head_dim=8, patch_size=2, pooling_kernel_size=2, position_embedding_size=16,
)
config._attn_implementation = "eager"
vision_tower = Gemma4VisionModel(config).eval()
for layer in vision_tower.encoder.layers:
    layer.self_attn.__class__ = QEffGemma4VisionAttention  # QEff's module-mapping transform
encoder = QEffGemma4EncoderWrapper(vision_tower).eval()


def patchify(height_patches, width_patches, max_patches):
    """Gemma4 image processor layout: flattened patches on a max-patch canvas, padding at (-1, -1)."""
    patch_dim = 3 * config.patch_size * config.patch_size
    n = height_patches * width_patches
    pixels = torch.zeros(max_patches, patch_dim)
    pixels[:n] = torch.rand(n, patch_dim)
    ys, xs = torch.meshgrid(torch.arange(height_patches), torch.arange(width_patches), indexing="ij")
    pos = torch.full((max_patches, 2), -1, dtype=torch.long)
    pos[:n] = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
    return pixels, pos


MAX_PATCHES = 16
images = [(4, 4), (2, 4)]  # the second image fills half of the canvas
pixel_values, image_position_ids = zip(*(patchify(h, w, MAX_PATCHES) for h, w in images))
pixel_values, image_position_ids = torch.stack(pixel_values), torch.stack(image_position_ids)

with torch.no_grad():
    soft_tokens, pooler_mask = encoder(pixel_values, image_position_ids)

for i, (h, w) in enumerate(images):
    tokens = soft_tokens[i][pooler_mask[i]]
    print(f"image {i} ({h}x{w} patches): {tokens.shape[0]} soft tokens, first row {tokens[0, :4].tolist()}")
    print(f"  soft-token norms {tokens.norm(dim=-1).tolist()}")
