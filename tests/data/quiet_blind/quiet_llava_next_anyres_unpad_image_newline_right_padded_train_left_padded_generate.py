"""LLaVA-NeXT (LLaVA-VL/LLaVA-NeXT): "anyres" images of different aspect ratios
resized and black-padded onto a grid of crops, the crops' features cut back to
the image's own area by unpad_image with an image_newline token per row, spliced
into each prompt at its <image> id, then the rows re-padded (right for training,
left for generation) with a rebuilt attention_mask and position_ids.

Ported from LLaVA-VL/LLaVA-NeXT @df179663ae8b83207df100a1f7af24caec633ff9
(llava_arch.py last changed in 85d0cd55ccac405e0e653586971d6c2aee41bb40):
  llava/mm_utils.py   select_best_resolution, resize_and_pad_image,
                      divide_to_patches, process_anyres_image,
                      get_anyres_image_grid_shape (PIL ops as tensor ops)
  llava/model/llava_arch.py  unpad_image, encode_images,
                      prepare_inputs_labels_for_multimodal (image branch,
                      mm_patch_merge_type "spatial_unpad", image_aspect_ratio
                      "anyres"; pads stripped with attention_mask, per-row
                      splice, re-pad by config.tokenizer_padding_side with
                      attention_mask / position_ids rebuilt)
  llava/model/multimodal_encoder/clip_encoder.py  feature_select
                      (hidden_states[-2], "patch" drops the CLS token)
  llava/model/multimodal_projector/builder.py  mlp2x_gelu
  llava/model/language_model/llava_llama.py  forward / generate
Tiny CLIPVisionModel and LlamaForCausalLM from transformers config classes,
random weights, CPU.

Checked against each prompt run alone (batch of one, no padding): the training
forward's logits at every real position and its loss against a double loop of
per-token cross entropy over the single runs; greedy generation with left
padding against each prompt generated alone; and the unpadded feature grid
against the pixels: every kept feature row / column lies mostly on the image,
every dropped one mostly on the black padding.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)

IGNORE_INDEX = -100
IMAGE_TOKEN_INDEX = -200
CLIP_MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073])[:, None, None]
CLIP_STD = torch.tensor([0.26862954, 0.26130258, 0.27577711])[:, None, None]


# ---------------------------------------------------------------- mm_utils.py
def select_best_resolution(original_size, possible_resolutions):
    original_width, original_height = original_size
    best_fit = None
    max_effective_resolution = 0
    min_wasted_resolution = float("inf")
    for width, height in possible_resolutions:
        scale = min(width / original_width, height / original_height)
        downscaled_width, downscaled_height = int(original_width * scale), int(original_height * scale)
        effective_resolution = min(downscaled_width * downscaled_height, original_width * original_height)
        wasted_resolution = (width * height) - effective_resolution
        if effective_resolution > max_effective_resolution or (
            effective_resolution == max_effective_resolution and wasted_resolution < min_wasted_resolution
        ):
            max_effective_resolution = effective_resolution
            min_wasted_resolution = wasted_resolution
            best_fit = (width, height)
    return best_fit


def image_resize(image, size_wh):
    return F.interpolate(image[None], size=(size_wh[1], size_wh[0]), mode="bilinear", align_corners=False)[0]


def resize_and_pad_image(image, target_resolution):
    """image: (3, H, W) in [0, 1]; black (0, 0, 0) canvas, pasted centred."""
    original_width, original_height = image.shape[2], image.shape[1]
    target_width, target_height = target_resolution
    scale_w = target_width / original_width
    scale_h = target_height / original_height
    if scale_w < scale_h:
        new_width = target_width
        new_height = min(math.ceil(original_height * scale_w), target_height)
    else:
        new_height = target_height
        new_width = min(math.ceil(original_width * scale_h), target_width)
    resized_image = image_resize(image, (new_width, new_height))
    new_image = torch.zeros(3, target_height, target_width)
    paste_x = (target_width - new_width) // 2
    paste_y = (target_height - new_height) // 2
    new_image[:, paste_y:paste_y + new_height, paste_x:paste_x + new_width] = resized_image
    return new_image, (paste_x, paste_y, new_width, new_height)


def divide_to_patches(image, patch_size):
    patches = []
    height, width = image.shape[1:]
    for i in range(0, height, patch_size):
        for j in range(0, width, patch_size):
            patches.append(image[:, i:i + patch_size, j:j + patch_size])
    return patches


def preprocess(image):
    return (image - CLIP_MEAN) / CLIP_STD


def process_anyres_image(image, crop_size, grid_pinpoints):
    possible_resolutions = grid_pinpoints
    best_resolution = select_best_resolution((image.shape[2], image.shape[1]), possible_resolutions)
    image_padded, paste = resize_and_pad_image(image, best_resolution)
    patches = divide_to_patches(image_padded, crop_size)
    image_original_resize = image_resize(image, (crop_size, crop_size))
    image_patches = [image_original_resize] + patches
    image_patches = [preprocess(p) for p in image_patches]
    return torch.stack(image_patches, dim=0), best_resolution, paste


def get_anyres_image_grid_shape(image_size, grid_pinpoints, patch_size):
    width, height = select_best_resolution(image_size, grid_pinpoints)
    return width // patch_size, height // patch_size


# ------------------------------------------------------------- llava_arch.py
def unpad_image(tensor, original_size):
    original_width, original_height = original_size
    current_height, current_width = tensor.shape[1:]
    original_aspect_ratio = original_width / original_height
    current_aspect_ratio = current_width / current_height
    if original_aspect_ratio > current_aspect_ratio:
        scale_factor = current_width / original_width
        new_height = int(original_height * scale_factor)
        padding = (current_height - new_height) // 2
        unpadded_tensor = tensor[:, padding: current_height - padding, :]
    else:
        scale_factor = current_height / original_height
        new_width = int(original_width * scale_factor)
        padding = (current_width - new_width) // 2
        unpadded_tensor = tensor[:, :, padding: current_width - padding]
    return unpadded_tensor


class LlavaLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config, vision_config):
        super().__init__(config)
        self.vision_tower = CLIPVisionModel(vision_config)
        self.mm_vision_select_layer = -2
        self.mm_vision_select_feature = "patch"
        self.mm_projector = nn.Sequential(
            nn.Linear(vision_config.hidden_size, config.hidden_size), nn.GELU(),
            nn.Linear(config.hidden_size, config.hidden_size),
        )
        embed_std = 1 / torch.sqrt(torch.tensor(config.hidden_size, dtype=torch.float32))
        self.model.image_newline = nn.Parameter(torch.randn(config.hidden_size) * embed_std)

    def get_model(self):
        return self.model

    def encode_images(self, images):
        outs = self.vision_tower(images, output_hidden_states=True)
        image_features = outs.hidden_states[self.mm_vision_select_layer]
        if self.mm_vision_select_feature == "patch":
            image_features = image_features[:, 1:]
        return self.mm_projector(image_features)

    def prepare_inputs_labels_for_multimodal(self, input_ids, position_ids, attention_mask, past_key_values,
                                             labels, images, modalities=["image"], image_sizes=None):
        if images is None or input_ids.shape[1] == 1:
            return input_ids, position_ids, attention_mask, past_key_values, None, labels

        images_list = [image if image.ndim == 4 else image.unsqueeze(0) for image in images]
        concat_images = torch.cat([image for image in images_list], dim=0)
        split_sizes = [image.shape[0] for image in images_list]
        encoded_image_features = self.encode_images(concat_images)
        image_features = list(torch.split(encoded_image_features, split_sizes))

        new_image_features = []
        for image_idx, image_feature in enumerate(image_features):
            if image_feature.shape[0] > 1:
                base_image_feature = image_feature[0]
                image_feature = image_feature[1:]
                height = width = self.vision_tower.config.image_size // self.vision_tower.config.patch_size
                assert height * width == base_image_feature.shape[0]
                num_patch_width, num_patch_height = get_anyres_image_grid_shape(
                    image_sizes[image_idx], self.config.image_grid_pinpoints, self.vision_tower.config.image_size
                )
                image_feature = image_feature.view(num_patch_height, num_patch_width, height, width, -1)
                # "spatial_unpad"
                image_feature = image_feature.permute(4, 0, 2, 1, 3).contiguous()
                image_feature = image_feature.flatten(1, 2).flatten(2, 3)
                image_feature = unpad_image(image_feature, image_sizes[image_idx])
                image_feature = torch.cat(
                    (image_feature, self.model.image_newline[:, None, None].expand(*image_feature.shape[:-1], 1)),
                    dim=-1,
                )
                image_feature = image_feature.flatten(1, 2).transpose(0, 1)
                image_feature = torch.cat((base_image_feature, image_feature), dim=0)
                new_image_features.append(image_feature)
            else:
                image_feature = image_feature[0]
                image_feature = torch.cat((image_feature, self.model.image_newline[None]), dim=0)
                new_image_features.append(image_feature)
        image_features = new_image_features

        _labels = labels
        _position_ids = position_ids
        _attention_mask = attention_mask
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            attention_mask = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(0, input_ids.shape[1], dtype=torch.long, device=input_ids.device)
        if labels is None:
            labels = torch.full_like(input_ids, IGNORE_INDEX)

        # remove the padding using attention_mask
        input_ids = [cur_input_ids[cur_attention_mask] for cur_input_ids, cur_attention_mask in zip(input_ids, attention_mask)]
        labels = [cur_labels[cur_attention_mask] for cur_labels, cur_attention_mask in zip(labels, attention_mask)]

        new_input_embeds = []
        new_labels = []
        cur_image_idx = 0
        for batch_idx, cur_input_ids in enumerate(input_ids):
            num_images = (cur_input_ids == IMAGE_TOKEN_INDEX).sum()
            if num_images == 0:
                cur_image_features = image_features[cur_image_idx]
                cur_input_embeds_1 = self.get_model().embed_tokens(cur_input_ids)
                cur_input_embeds = torch.cat([cur_input_embeds_1, cur_image_features[0:0]], dim=0)
                new_input_embeds.append(cur_input_embeds)
                new_labels.append(labels[batch_idx])
                cur_image_idx += 1
                continue

            image_token_indices = [-1] + torch.where(cur_input_ids == IMAGE_TOKEN_INDEX)[0].tolist() + [cur_input_ids.shape[0]]
            cur_input_ids_noim = []
            cur_labels = labels[batch_idx]
            cur_labels_noim = []
            for i in range(len(image_token_indices) - 1):
                cur_input_ids_noim.append(cur_input_ids[image_token_indices[i] + 1: image_token_indices[i + 1]])
                cur_labels_noim.append(cur_labels[image_token_indices[i] + 1: image_token_indices[i + 1]])
            split_sizes = [x.shape[0] for x in cur_labels_noim]
            cur_input_embeds = self.get_model().embed_tokens(torch.cat(cur_input_ids_noim))
            cur_input_embeds_no_im = torch.split(cur_input_embeds, split_sizes, dim=0)
            cur_new_input_embeds = []
            cur_new_labels = []
            for i in range(num_images + 1):
                cur_new_input_embeds.append(cur_input_embeds_no_im[i])
                cur_new_labels.append(cur_labels_noim[i])
                if i < num_images:
                    cur_image_features = image_features[cur_image_idx]
                    cur_image_idx += 1
                    cur_new_input_embeds.append(cur_image_features)
                    cur_new_labels.append(torch.full((cur_image_features.shape[0],), IGNORE_INDEX, dtype=cur_labels.dtype))
            new_input_embeds.append(torch.cat(cur_new_input_embeds))
            new_labels.append(torch.cat(cur_new_labels))

        tokenizer_model_max_length = getattr(self.config, "tokenizer_model_max_length", None)
        new_input_embeds = [x[:tokenizer_model_max_length] for x in new_input_embeds]
        new_labels = [x[:tokenizer_model_max_length] for x in new_labels]

        max_len = max(x.shape[0] for x in new_input_embeds)
        batch_size = len(new_input_embeds)
        new_input_embeds_padded = []
        new_labels_padded = torch.full((batch_size, max_len), IGNORE_INDEX, dtype=new_labels[0].dtype)
        attention_mask = torch.zeros((batch_size, max_len), dtype=attention_mask.dtype)
        position_ids = torch.zeros((batch_size, max_len), dtype=position_ids.dtype)

        for i, (cur_new_embed, cur_new_labels) in enumerate(zip(new_input_embeds, new_labels)):
            cur_len = cur_new_embed.shape[0]
            if getattr(self.config, "tokenizer_padding_side", "right") == "left":
                new_input_embeds_padded.append(torch.cat((torch.zeros((max_len - cur_len, cur_new_embed.shape[1]), dtype=cur_new_embed.dtype), cur_new_embed), dim=0))
                if cur_len > 0:
                    new_labels_padded[i, -cur_len:] = cur_new_labels
                    attention_mask[i, -cur_len:] = True
                    position_ids[i, -cur_len:] = torch.arange(0, cur_len, dtype=position_ids.dtype)
            else:
                new_input_embeds_padded.append(torch.cat((cur_new_embed, torch.zeros((max_len - cur_len, cur_new_embed.shape[1]), dtype=cur_new_embed.dtype)), dim=0))
                if cur_len > 0:
                    new_labels_padded[i, :cur_len] = cur_new_labels
                    attention_mask[i, :cur_len] = True
                    position_ids[i, :cur_len] = torch.arange(0, cur_len, dtype=position_ids.dtype)

        new_input_embeds = torch.stack(new_input_embeds_padded, dim=0)
        new_labels = None if _labels is None else new_labels_padded
        attention_mask = None if _attention_mask is None else attention_mask.to(dtype=_attention_mask.dtype)
        if _position_ids is None:
            position_ids = None
        return None, position_ids, attention_mask, past_key_values, new_input_embeds, new_labels

    # llava_llama.py
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, images=None, image_sizes=None, modalities=["image"], **kwargs):
        if inputs_embeds is None:
            (input_ids, position_ids, attention_mask, past_key_values, inputs_embeds, labels) = \
                self.prepare_inputs_labels_for_multimodal(input_ids, position_ids, attention_mask, past_key_values,
                                                          labels, images, modalities, image_sizes)
        if past_key_values is not None:  # transformers 5.x hands the cache in as `cache`
            kwargs["cache"] = past_key_values
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               inputs_embeds=inputs_embeds, labels=labels, **kwargs)

    @torch.no_grad()
    def generate(self, inputs=None, images=None, image_sizes=None, modalities=["image"], **kwargs):
        position_ids = kwargs.pop("position_ids", None)
        attention_mask = kwargs.pop("attention_mask", None)
        (inputs, position_ids, attention_mask, _, inputs_embeds, _) = self.prepare_inputs_labels_for_multimodal(
            inputs, position_ids, attention_mask, None, None, images, modalities, image_sizes=image_sizes)
        return super().generate(position_ids=position_ids, attention_mask=attention_mask,
                                inputs_embeds=inputs_embeds, **kwargs)


CROP = 28
vision_config = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 image_size=CROP, patch_size=7)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
config.image_grid_pinpoints = [[28, 56], [56, 28], [56, 56]]  # (width, height)
config.tokenizer_padding_side = "right"
config._attn_implementation = "sdpa"
model = LlavaLlamaForCausalLM(config, vision_config).eval()

# a wide, a tall and a square image, (W, H) = image.size as PIL gives it
raw_images = [torch.rand(3, 12, 60), torch.rand(3, 50, 14), torch.rand(3, 40, 40)]
image_sizes = [(im.shape[2], im.shape[1]) for im in raw_images]
processed = [process_anyres_image(im, CROP, config.image_grid_pinpoints) for im in raw_images]
images = [p[0] for p in processed]

# the unpadded grid against the pixels: each feature cell covers a 7 x 7 pixel block of the canvas
side = CROP // 7
for (W, H), (crops, best, (px, py, nw, nh)) in zip(image_sizes, processed):
    bw, bh = best
    rows, cols = bh // 7, bw // 7
    real = torch.zeros(bh, bw)
    real[py:py + nh, px:px + nw] = 1
    grid = torch.arange(rows * cols, dtype=torch.float).view(1, rows, cols)
    kept = unpad_image(grid, (W, H))
    kept_ids = set(kept.flatten().long().tolist())
    for r in range(rows):
        for c in range(cols):
            on_image = real[r * 7:(r + 1) * 7, c * 7:(c + 1) * 7].mean().item()
            if r * cols + c in kept_ids:
                assert on_image > 0.5, (W, H, r, c, on_image)
            else:
                assert on_image < 0.5, (W, H, r, c, on_image)

# prompts: "<bos> q q <image> q ... | answer ... <eos>"
prompts = [[1, 5, 6, IMAGE_TOKEN_INDEX, 7, 8, 9], [1, IMAGE_TOKEN_INDEX, 10, 11], [1, 12, IMAGE_TOKEN_INDEX, 13, 14, 15, 16, 17]]
answers = [[20, 21, 22, 2], [23, 24, 25, 26, 27, 2], [28, 2]]
rows = [p + a for p, a in zip(prompts, answers)]
L = max(len(r) for r in rows)
input_ids = torch.full((3, L), config.pad_token_id, dtype=torch.long)
labels = torch.full((3, L), IGNORE_INDEX, dtype=torch.long)
attention_mask = torch.zeros((3, L), dtype=torch.long)
for i, (p, a) in enumerate(zip(prompts, answers)):
    input_ids[i, :len(p) + len(a)] = torch.tensor(p + a)
    labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
    attention_mask[i, :len(p) + len(a)] = 1

ATOL = 1e-4
with torch.no_grad():
    # training forward, tokenizer_padding_side "right"
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, images=images, image_sizes=image_sizes)
    _, _, am, _, embeds, new_labels = model.prepare_inputs_labels_for_multimodal(
        input_ids, None, attention_mask, None, labels, images, image_sizes=image_sizes)
    n_img = [side * side + f for f in (2 * (8 + 1), 8 * (2 + 1), 8 * (8 + 1))]
    lens = [len(r) - 1 + n for r, n in zip(rows, n_img)]
    assert am.sum(-1).tolist() == lens

    total, count = 0.0, 0
    for i in range(3):
        one_ids = torch.tensor([rows[i]])
        one_labels = torch.full_like(one_ids, IGNORE_INDEX)
        one_labels[0, len(prompts[i]):] = torch.tensor(answers[i])
        one = model(input_ids=one_ids, attention_mask=torch.ones_like(one_ids), labels=one_labels,
                    images=[images[i]], image_sizes=[image_sizes[i]])
        assert one.logits.shape[1] == lens[i]
        assert torch.allclose(out.logits[i, :lens[i]], one.logits[0], atol=ATOL)
        # the shifted per-token cross entropy, one token at a time
        _, _, _, _, _, one_new_labels = model.prepare_inputs_labels_for_multimodal(
            one_ids, None, torch.ones_like(one_ids), None, one_labels, [images[i]], image_sizes=[image_sizes[i]])
        for t in range(lens[i] - 1):
            tgt = int(one_new_labels[0, t + 1])
            if tgt != IGNORE_INDEX:
                total += -torch.log_softmax(one.logits[0, t], -1)[tgt].item()
                count += 1
    assert count == sum(len(a) for a in answers)
    assert abs(out.loss.item() - total / count) < 1e-4

    # generation, tokenizer_padding_side "left"
    model.config.tokenizer_padding_side = "left"
    prompt_ids = torch.full((3, max(len(p) for p in prompts)), config.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for i, p in enumerate(prompts):
        prompt_ids[i, :len(p)] = torch.tensor(p)
        prompt_mask[i, :len(p)] = 1
    gen = model.generate(prompt_ids, images=images, image_sizes=image_sizes, attention_mask=prompt_mask,
                         do_sample=False, max_new_tokens=5, min_new_tokens=5, pad_token_id=config.pad_token_id)
    for i, p in enumerate(prompts):
        one_ids = torch.tensor([p])
        one = model.generate(one_ids, images=[images[i]], image_sizes=[image_sizes[i]],
                             attention_mask=torch.ones_like(one_ids), do_sample=False, max_new_tokens=5,
                             min_new_tokens=5, pad_token_id=config.pad_token_id)
        assert gen[i].tolist() == one[0].tolist(), (i, gen[i].tolist(), one[0].tolist())

print("ok: LLaVA-NeXT anyres unpadded features, right-padded training and left-padded generation match each prompt alone")
