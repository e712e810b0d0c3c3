"""eole HunyuanOCR vision encoder: a batch of images encoded as one sequence with no block-diagonal mask.

Citation: eole-nlp/eole#280 "Support batches of images with HunyuanOCR" (opened 2025-12-08, merged),
following eole-nlp/eole#273 which added HunyuanOCR to eole's ``VisionEncoder``.
Bug (PR description): "It does not support batches of images because all images are concatenated
along the 'number of patches' dimension, hence the attention is performed in a wrong way." In eole's
vision encoder the pixtral/mistral path builds a block-diagonal pad mask from the per-image patch
counts, but the HunyuanOCR path (no pre-layernorm, per-image interpolated position embeddings)
concatenated the images' patches and ran the transformer layers with ``mask=None``, so patches of
one image attended to every other image in the batch. (The same upstream HF/vLLM design flaw was
fixed in vLLM by vllm-project/vllm#30344 by splitting per image; eole fixed its own encoder with a mask.)
Fix: build the block-diagonal mask for HunyuanOCR as for pixtral and pass it to every layer.
Reproduction: eole's conventions: a config dataclass (``VisionEncoderConfig``), ``image_sizes`` per
image, a mask where True marks a key that must NOT be attended (eole's pad-mask polarity), inverted
before F.scaled_dot_product_attention. Three images of 3x4, 2x2 and 4x4 patches. I read the PR
description only; the code follows the structure of eole/encoders/vision.py as the PR describes it.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class VisionEncoderConfig:
    hidden_size: int = 32
    heads: int = 4
    transformer_ff: int = 64
    layers: int = 2
    patch_size: int = 4
    num_channels: int = 3
    layernorm_pre: bool = False  # True for pixtral/mistral False for gemma3/hunyuan
    encoder_sam: bool = False
    model_type: str = "hunyuan_ocr"


def create_block_diagonal_mask(lengths, device=None):
    """True where attention must be blocked (key outside the query's image)."""
    total = sum(lengths)
    mask = torch.ones(total, total, dtype=torch.bool, device=device)
    start = 0
    for n in lengths:
        mask[start:start + n, start:start + n] = False
        start += n
    return mask


class MultiHeadedAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads = config.heads
        self.dim_per_head = config.hidden_size // config.heads
        self.linear_query = nn.Linear(config.hidden_size, config.hidden_size)
        self.linear_keys = nn.Linear(config.hidden_size, config.hidden_size)
        self.linear_values = nn.Linear(config.hidden_size, config.hidden_size)
        self.final_linear = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, mask=None):
        b, s, _ = x.shape
        shape = lambda t: t.view(b, s, self.heads, self.dim_per_head).transpose(1, 2)
        q, k, v = shape(self.linear_query(x)), shape(self.linear_keys(x)), shape(self.linear_values(x))
        attn_mask = None if mask is None else ~mask  # eole masks are True = blocked
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.final_linear(out.transpose(1, 2).reshape(b, s, -1))


class TransformerEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.self_attn = MultiHeadedAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.transformer_ff), nn.GELU(),
                                 nn.Linear(config.transformer_ff, config.hidden_size))

    def forward(self, x, pad_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), mask=pad_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionEncoderConfig):
        super().__init__()
        self.config = config
        self.patch_conv = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size, config.patch_size)
        self.position_embedding = nn.Parameter(torch.randn(config.hidden_size, 8, 8) * 0.02)
        self.ln_pre = nn.LayerNorm(config.hidden_size) if config.layernorm_pre else nn.Identity()
        self.transformer_layers = nn.ModuleList([TransformerEncoderLayer(config) for _ in range(config.layers)])

    def forward(self, images):
        patch_embeds_list = [self.patch_conv(img.unsqueeze(0)).squeeze(0) for img in images]  # (D, h, w)
        image_sizes = [tuple(p.shape[-2:]) for p in patch_embeds_list]
        if self.config.model_type == "hunyuan_ocr":
            # per-image bilinear interpolation of the position grid
            patch_embeds_list = [
                p + F.interpolate(self.position_embedding[None], size=p.shape[-2:], mode="bilinear",
                                  align_corners=False)[0] for p in patch_embeds_list]
        patch_embeds = torch.cat([p.flatten(1).t() for p in patch_embeds_list], dim=0).unsqueeze(0)
        patch_embeds = self.ln_pre(patch_embeds)

        lengths = [h * w for h, w in image_sizes]
        if self.config.layernorm_pre or FIXED:
            # pixtral/mistral: block-diagonal mask so that each image only attends to itself
            mask = create_block_diagonal_mask(lengths, device=patch_embeds.device)
        else:
            mask = None
        out = patch_embeds
        for layer in self.transformer_layers:
            out = layer(out, pad_mask=mask)
        return out.squeeze(0).split(lengths, dim=0)


def main():
    torch.manual_seed(0)
    config = VisionEncoderConfig()
    encoder = VisionEncoder(config).eval()
    images = [torch.randn(3, 12, 16), torch.randn(3, 8, 8), torch.randn(3, 16, 16)]
    with torch.no_grad():
        feats = encoder(images)
    print("fixed" if FIXED else "buggy", [tuple(f.shape) for f in feats],
          " ".join(f"{f.abs().mean().item():.6f}" for f in feats))


if __name__ == "__main__":
    main()
