"""mlx-vlm LFM2-VL: the SigLIP2 (NaFlex) vision tower ran without the patch padding mask.

Citation: Blaizzy/mlx-vlm#2266 ("fix: correct LFM2-VL/LFM2.5-VL vision tower and preprocessing",
merged). Code before the fix read at mlx_vlm/models/lfm2_vl/vision.py @0942a56 and
mlx_vlm/models/lfm2_vl/lfm2_vl.py @045d5b7; ported from MLX to torch.

LFM2-VL packs each image as a variable number of patches (spatial_shapes[i] = (h, w) patches)
padded to one length, with `pixel_attention_mask` marking the real patches. The model reads it
only to slice each image's features back out (`feature[: img_feature_lengths[img_idx]]`); the
vision tower itself calls `self.encoder(x=x, ..., mask=None)`, so the real patches of a smaller
image attend to its padded patches in every layer.

The fix (per the PR: "Masks padded patch rows in the vision tower from pixel_attention_mask, the
way SigLIP2 does") hands `pixel_attention_mask` to the vision tower and turns it into a key mask
for every encoder layer. The PR's other changes (bilinear+antialias position-embedding resize,
processor settings) are left out: both runs resize the same way.

Toy sizes, random weights: two images of 4x6 and 2x4 patches padded to 24 patches, one prompt
holding both images' tokens.
"""

import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class VisionConfig:
    model_type: str = "lfm2_vl"
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_channels: int = 3
    image_size: int = 16
    patch_size: int = 4
    num_patches: int = 16
    layer_norm_eps: float = 1e-06


@dataclass
class TextConfig:
    hidden_size: int = 24
    vocab_size: int = 512


@dataclass
class ModelConfig:
    text_config: TextConfig
    vision_config: VisionConfig
    model_type: str = "lfm2-vl"
    image_token_index: int = 396
    downsample_factor: int = 2
    projector_hidden_size: int = 48
    projector_bias: bool = True
    projector_use_layernorm: bool = True
    vision_feature_layer: int = -1


class Attention(nn.Module):
    def __init__(self, dims: int, num_heads: int, bias: bool = True):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dims // num_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dims, dims, bias=bias)
        self.k_proj = nn.Linear(dims, dims, bias=bias)
        self.v_proj = nn.Linear(dims, dims, bias=bias)
        self.out_proj = nn.Linear(dims, dims, bias=bias)

    def forward(self, x, mask=None):
        queries = self.q_proj(x)
        keys = self.k_proj(x)
        values = self.v_proj(x)

        num_heads = self.num_heads
        B, L, D = queries.shape
        _, S, _ = keys.shape
        queries = queries.reshape(B, L, num_heads, -1).transpose(1, 2)
        keys = keys.reshape(B, S, num_heads, -1).transpose(1, 2)
        values = values.reshape(B, S, num_heads, -1).transpose(1, 2)

        output = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=self.scale
        )
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.out_proj(output)


class MLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.activation_fn = nn.GELU(approximate="none")
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x):
        return self.fc2(self.activation_fn(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.self_attn = Attention(config.hidden_size, config.num_attention_heads, bias=True)
        self.layer_norm1 = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_eps)
        self.mlp = MLP(config)
        self.layer_norm2 = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_eps)

    def forward(self, x, mask=None):
        r = self.self_attn(self.layer_norm1(x), mask)
        h = x + r
        r = self.mlp(self.layer_norm2(h))
        return h + r


class Encoder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(
            [EncoderLayer(config) for _ in range(config.num_hidden_layers)]
        )

    def forward(self, x, output_hidden_states: Optional[bool] = None, mask=None):
        encoder_states = (x,) if output_hidden_states else None
        for l in self.layers:
            x = l(x, mask=mask)
            if output_hidden_states:
                encoder_states = encoder_states + (x,)
        return encoder_states


class VisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.embed_dim = config.hidden_size
        self.patch_size = config.patch_size
        self.patch_embedding = nn.Linear(
            config.num_channels * self.patch_size * self.patch_size, self.embed_dim
        )
        self.num_patches = config.num_patches
        self.position_embedding_size = int(self.num_patches**0.5)
        self.position_embedding = nn.Embedding(self.num_patches, self.embed_dim)

    @staticmethod
    def resize_positional_embeddings(positional_embeddings, spatial_shapes, max_length):
        batch_size = spatial_shapes.shape[0]
        embed_dim = positional_embeddings.shape[-1]
        resulted_positional_embeddings = torch.zeros(
            (batch_size, max_length, embed_dim), dtype=positional_embeddings.dtype
        )
        # (height, width, embed_dim) -> (1, embed_dim, height, width) for interpolation
        positional_embeddings = positional_embeddings.permute(2, 0, 1)[None, :]
        for i in range(batch_size):
            height, width = spatial_shapes[i].tolist()
            resized_embeddings = F.interpolate(
                positional_embeddings, size=(height, width), mode="bicubic", align_corners=False
            )
            resized_embeddings = resized_embeddings.reshape(embed_dim, height * width).transpose(1, 0)
            resulted_positional_embeddings[i, : height * width] = resized_embeddings
            resulted_positional_embeddings[i, height * width :] = resized_embeddings[0]
        return resulted_positional_embeddings

    def forward(self, pixel_values, spatial_shapes=None):
        patch_embeds = self.patch_embedding(pixel_values)
        positional_embeddings = self.position_embedding.weight.reshape(
            self.position_embedding_size, self.position_embedding_size, -1
        )
        resized_positional_embeddings = self.resize_positional_embeddings(
            positional_embeddings, spatial_shapes, max_length=pixel_values.shape[1]
        )
        return patch_embeds + resized_positional_embeddings


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.model_type = config.model_type
        self.embeddings = VisionEmbeddings(config)
        self.encoder = Encoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size)

    def forward(self, x, output_hidden_states=None, spatial_shapes=None, pixel_attention_mask=None):
        x = self.embeddings(x, spatial_shapes=spatial_shapes)
        if FIXED and pixel_attention_mask is not None:
            valid = pixel_attention_mask.bool()[:, None, None, :]
            mask = torch.zeros(valid.shape, dtype=x.dtype).masked_fill(
                ~valid, torch.finfo(x.dtype).min
            )
        else:
            mask = None
        encoder_outputs = self.encoder(x=x, output_hidden_states=output_hidden_states, mask=mask)
        last_hidden_state = self.post_layernorm(encoder_outputs[-1])
        return encoder_outputs, x, last_hidden_state


class Lfm2VlMultiModalProjector(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        in_channels = config.vision_config.hidden_size * (config.downsample_factor**2)
        self.layer_norm = nn.LayerNorm(in_channels) if config.projector_use_layernorm else nn.Identity()
        self.linear_1 = nn.Linear(in_channels, config.projector_hidden_size, bias=config.projector_bias)
        self.linear_2 = nn.Linear(
            config.projector_hidden_size, config.text_config.hidden_size, bias=config.projector_bias
        )

    def forward(self, x):
        x = self.linear_1(self.layer_norm(x))
        return self.linear_2(F.gelu(x))


class PixelUnshuffleBlock(nn.Module):
    def __init__(self, factor: int):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        n, w, h, c = x.shape
        if w % self.factor != 0:
            x = torch.cat([x, x.new_zeros((n, self.factor - (w % self.factor), h, c))], dim=1)
            n, w, h, c = x.shape
        if h % self.factor != 0:
            x = torch.cat([x, x.new_zeros((n, w, self.factor - (h % self.factor), c))], dim=2)
            n, w, h, c = x.shape
        x = x.reshape(n, w, int(h / self.factor), int(c * self.factor))
        x = x.permute(0, 2, 1, 3)
        x = x.reshape(n, int(h / self.factor), int(w / self.factor), int(c * self.factor**2))
        x = x.permute(0, 2, 1, 3)
        return x


class Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.vision_tower = VisionModel(config.vision_config)
        self.pixel_unshuffle = PixelUnshuffleBlock(config.downsample_factor)
        self.multi_modal_projector = Lfm2VlMultiModalProjector(config)
        self.embed_tokens = nn.Embedding(config.text_config.vocab_size, config.text_config.hidden_size)

    def get_input_embeddings(self, input_ids, pixel_values=None, **kwargs):
        spatial_shapes = kwargs.get("spatial_shapes", None)
        pixel_attention_mask = kwargs.get("pixel_attention_mask", None)

        inputs_embeds = self.embed_tokens(input_ids)
        if pixel_values is None:
            return inputs_embeds

        if FIXED:
            *_, hidden_states = self.vision_tower(
                pixel_values,
                output_hidden_states=True,
                spatial_shapes=spatial_shapes,
                pixel_attention_mask=pixel_attention_mask,
            )
        else:
            *_, hidden_states = self.vision_tower(
                pixel_values, output_hidden_states=True, spatial_shapes=spatial_shapes
            )

        img_feature_lengths = pixel_attention_mask.sum(dim=1).tolist()
        image_features = []
        for img_idx in range(hidden_states.shape[0]):
            feature = hidden_states[img_idx]
            feature = feature[: img_feature_lengths[img_idx], :][None, ...]
            feature_org_h, feature_org_w = spatial_shapes[img_idx].tolist()
            feature = feature.reshape(1, feature_org_h, feature_org_w, -1)
            feature = self.pixel_unshuffle(feature)
            img_embedding = self.multi_modal_projector(feature)
            img_embedding = img_embedding.reshape(-1, img_embedding.shape[-1])
            image_features.append(img_embedding)
        image_features = torch.cat(image_features, dim=0)

        return self.merge_input_ids_with_image_features(
            image_features, inputs_embeds, input_ids, self.config.image_token_index
        )

    @staticmethod
    def merge_input_ids_with_image_features(image_features, inputs_embeds, input_ids, image_token_index):
        special_image_mask = (input_ids == image_token_index)[..., None].expand_as(inputs_embeds)
        if special_image_mask.sum() != image_features.numel():
            raise ValueError("Image features and image tokens do not match")
        return inputs_embeds.masked_scatter(special_image_mask, image_features)


def main():
    torch.manual_seed(0)
    config = ModelConfig(text_config=TextConfig(), vision_config=VisionConfig())
    model = Model(config).eval()

    vc = config.vision_config
    patch_dim = vc.num_channels * vc.patch_size * vc.patch_size
    spatial_shapes = torch.tensor([[4, 6], [2, 4]])
    max_num_patches = 24
    pixel_values = torch.zeros(2, max_num_patches, patch_dim)
    pixel_attention_mask = torch.zeros(2, max_num_patches, dtype=torch.long)
    for i, (h, w) in enumerate(spatial_shapes.tolist()):
        pixel_values[i, : h * w] = torch.randn(h * w, patch_dim)
        pixel_attention_mask[i, : h * w] = 1

    # image tokens after the 2x pixel unshuffle: 2*3 = 6 and 1*2 = 2
    img = config.image_token_index
    input_ids = torch.tensor([[1, 10, 11] + [img] * 6 + [12] + [img] * 2 + [13, 14]])

    with torch.no_grad():
        embeds = model.get_input_embeddings(
            input_ids,
            pixel_values,
            spatial_shapes=spatial_shapes,
            pixel_attention_mask=pixel_attention_mask,
        )
    first = embeds[0, 3:9]
    second = embeds[0, 10:12]
    print("fixed" if FIXED else "buggy")
    print("image 1 tokens, sum:", round(first.sum().item(), 6))
    print("image 2 tokens, sum:", round(second.sum().item(), 6))
    print("image 2 token 0:", [round(v, 4) for v in second[0, :6].tolist()])


if __name__ == "__main__":
    main()
