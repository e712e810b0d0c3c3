"""LLaVA (haotian-liu/LLaVA) batched greedy generation over a left-padded batch of image prompts.

Correct program. Port (tokenizer, conversation templates and CLIPImageProcessor left out: prompt ids with
IMAGE_TOKEN_INDEX and pixel tensors are given directly; the CLIP tower built from a tiny CLIPVisionConfig instead of
`from_pretrained`) of haotian-liu/LLaVA @c121f0432da27facab705978f83c4ada465e46fd:
* llava/model/llava_arch.py: LlavaMetaModel, LlavaMetaForCausalLM.encode_images and
  prepare_inputs_labels_for_multimodal (flat merge: padding stripped with the attention mask, each IMAGE_TOKEN_INDEX
  replaced by the image's projected patches, rows re-padded on `config.tokenizer_padding_side`, the new
  attention_mask built from each row's new length);
* llava/model/language_model/llava_llama.py: LlavaConfig, LlavaLlamaModel, LlavaLlamaForCausalLM (forward,
  generate: the prompt embedded once, then `LlamaForCausalLM.generate(inputs_embeds=..., attention_mask=...)`);
* llava/model/multimodal_encoder/clip_encoder.py: CLIPVisionTower (hidden_states[select_layer], "patch" drops CLS);
* llava/model/multimodal_projector/builder.py: build_vision_projector ("mlp2x_gelu");
* llava/train/train.py: `model.config.tokenizer_padding_side = tokenizer.padding_side` (left for batched inference).
Adapted to transformers 5: `past_key_values` is named `cache` there, and forward passes the other generation kwargs
(logits_to_keep, ...) on.

Check: three prompts (one image, two images, one image with a long question) are left-padded together with pad id 0
and generated greedily; each row's new tokens and per-step logits must equal the same prompt generated alone
(batch of one, no padding).
"""
import re
from typing import List, Optional

import torch
import torch.nn as nn
from transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM, LlamaModel

IGNORE_INDEX = -100
IMAGE_TOKEN_INDEX = -200


class CLIPVisionTower(nn.Module):
    def __init__(self, vision_cfg, args):
        super().__init__()
        self.select_layer = args.mm_vision_select_layer
        self.select_feature = getattr(args, "mm_vision_select_feature", "patch")
        self.vision_tower = CLIPVisionModel(vision_cfg)
        self.vision_tower.requires_grad_(False)
        self.is_loaded = True

    def feature_select(self, image_forward_outs):
        image_features = image_forward_outs.hidden_states[self.select_layer]
        if self.select_feature == "patch":
            image_features = image_features[:, 1:]
        elif self.select_feature == "cls_patch":
            image_features = image_features
        else:
            raise ValueError(f"Unexpected select feature: {self.select_feature}")
        return image_features

    @torch.no_grad()
    def forward(self, images):
        image_forward_outs = self.vision_tower(images.to(dtype=self.dtype), output_hidden_states=True)
        return self.feature_select(image_forward_outs).to(images.dtype)

    @property
    def dtype(self):
        return self.vision_tower.dtype

    @property
    def hidden_size(self):
        return self.vision_tower.config.hidden_size


def build_vision_projector(config):
    projector_type = getattr(config, "mm_projector_type", "linear")
    if projector_type == "linear":
        return nn.Linear(config.mm_hidden_size, config.hidden_size)
    mlp_gelu_match = re.match(r"^mlp(\d+)x_gelu$", projector_type)
    if mlp_gelu_match:
        mlp_depth = int(mlp_gelu_match.group(1))
        modules = [nn.Linear(config.mm_hidden_size, config.hidden_size)]
        for _ in range(1, mlp_depth):
            modules.append(nn.GELU())
            modules.append(nn.Linear(config.hidden_size, config.hidden_size))
        return nn.Sequential(*modules)
    raise ValueError(f"Unknown projector type: {projector_type}")


class LlavaMetaModel:
    def __init__(self, config):
        super(LlavaMetaModel, self).__init__(config)
        if hasattr(config, "mm_vision_tower"):
            self.vision_tower = CLIPVisionTower(CLIPVisionConfig(**config.mm_vision_tower), config)
            self.mm_projector = build_vision_projector(config)

    def get_vision_tower(self):
        return getattr(self, "vision_tower", None)


class LlavaMetaForCausalLM:
    def get_vision_tower(self):
        return self.get_model().get_vision_tower()

    def encode_images(self, images):
        image_features = self.get_model().get_vision_tower()(images)
        image_features = self.get_model().mm_projector(image_features)
        return image_features

    def prepare_inputs_labels_for_multimodal(
        self, input_ids, position_ids, attention_mask, past_key_values, labels, images, image_sizes=None
    ):
        vision_tower = self.get_vision_tower()
        if vision_tower is None or images is None or input_ids.shape[1] == 1:
            return input_ids, position_ids, attention_mask, past_key_values, None, labels

        image_features = self.encode_images(images)

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
                cur_input_ids_noim.append(cur_input_ids[image_token_indices[i] + 1:image_token_indices[i + 1]])
                cur_labels_noim.append(cur_labels[image_token_indices[i] + 1:image_token_indices[i + 1]])
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
                    cur_new_labels.append(torch.full((cur_image_features.shape[0],), IGNORE_INDEX, device=cur_labels.device, dtype=cur_labels.dtype))

            new_input_embeds.append(torch.cat(cur_new_input_embeds))
            new_labels.append(torch.cat(cur_new_labels))

        tokenizer_model_max_length = getattr(self.config, "tokenizer_model_max_length", None)
        if tokenizer_model_max_length is not None:
            new_input_embeds = [x[:tokenizer_model_max_length] for x in new_input_embeds]
            new_labels = [x[:tokenizer_model_max_length] for x in new_labels]

        # Combine them
        max_len = max(x.shape[0] for x in new_input_embeds)
        batch_size = len(new_input_embeds)

        new_input_embeds_padded = []
        new_labels_padded = torch.full((batch_size, max_len), IGNORE_INDEX, dtype=new_labels[0].dtype, device=new_labels[0].device)
        attention_mask = torch.zeros((batch_size, max_len), dtype=attention_mask.dtype, device=attention_mask.device)
        position_ids = torch.zeros((batch_size, max_len), dtype=position_ids.dtype, device=position_ids.device)

        for i, (cur_new_embed, cur_new_labels) in enumerate(zip(new_input_embeds, new_labels)):
            cur_len = cur_new_embed.shape[0]
            if getattr(self.config, "tokenizer_padding_side", "right") == "left":
                new_input_embeds_padded.append(torch.cat((
                    torch.zeros((max_len - cur_len, cur_new_embed.shape[1]), dtype=cur_new_embed.dtype, device=cur_new_embed.device),
                    cur_new_embed
                ), dim=0))
                if cur_len > 0:
                    new_labels_padded[i, -cur_len:] = cur_new_labels
                    attention_mask[i, -cur_len:] = True
                    position_ids[i, -cur_len:] = torch.arange(0, cur_len, dtype=position_ids.dtype, device=position_ids.device)
            else:
                new_input_embeds_padded.append(torch.cat((
                    cur_new_embed,
                    torch.zeros((max_len - cur_len, cur_new_embed.shape[1]), dtype=cur_new_embed.dtype, device=cur_new_embed.device)
                ), dim=0))
                if cur_len > 0:
                    new_labels_padded[i, :cur_len] = cur_new_labels
                    attention_mask[i, :cur_len] = True
                    position_ids[i, :cur_len] = torch.arange(0, cur_len, dtype=position_ids.dtype, device=position_ids.device)

        new_input_embeds = torch.stack(new_input_embeds_padded, dim=0)

        new_labels = None if _labels is None else new_labels_padded
        if _attention_mask is None:
            attention_mask = None
        else:
            attention_mask = attention_mask.to(dtype=_attention_mask.dtype)
        if _position_ids is None:
            position_ids = None

        return None, position_ids, attention_mask, past_key_values, new_input_embeds, new_labels


class LlavaConfig(LlamaConfig):
    model_type = "llava_llama"


class LlavaLlamaModel(LlavaMetaModel, LlamaModel):
    config_class = LlavaConfig

    def __init__(self, config: LlamaConfig):
        super(LlavaLlamaModel, self).__init__(config)


class LlavaLlamaForCausalLM(LlamaForCausalLM, LlavaMetaForCausalLM):
    config_class = LlavaConfig

    def __init__(self, config):
        super(LlamaForCausalLM, self).__init__(config)
        self.model = LlavaLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_model(self):
        return self.model

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, images=None, image_sizes=None, **kwargs):
        if inputs_embeds is None:
            (
                input_ids, position_ids, attention_mask, cache, inputs_embeds, labels
            ) = self.prepare_inputs_labels_for_multimodal(
                input_ids, position_ids, attention_mask, cache, labels, images, image_sizes
            )
        return super().forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
            **kwargs,
        )

    @torch.no_grad()
    def generate(self, inputs: Optional[torch.Tensor] = None, images: Optional[torch.Tensor] = None,
                 image_sizes=None, **kwargs):
        position_ids = kwargs.pop("position_ids", None)
        attention_mask = kwargs.pop("attention_mask", None)
        if "inputs_embeds" in kwargs:
            raise NotImplementedError("`inputs_embeds` is not supported")

        if images is not None:
            (
                inputs, position_ids, attention_mask, _, inputs_embeds, _
            ) = self.prepare_inputs_labels_for_multimodal(
                inputs, position_ids, attention_mask, None, None, images, image_sizes=image_sizes
            )
        else:
            inputs_embeds = self.get_model().embed_tokens(inputs)

        return super().generate(position_ids=position_ids, attention_mask=attention_mask,
                                inputs_embeds=inputs_embeds, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, cache=None, inputs_embeds=None, **kwargs):
        images = kwargs.pop("images", None)
        image_sizes = kwargs.pop("image_sizes", None)
        inputs = super().prepare_inputs_for_generation(
            input_ids, cache=cache, inputs_embeds=inputs_embeds, **kwargs
        )
        if images is not None:
            inputs["images"] = images
        if image_sizes is not None:
            inputs["image_sizes"] = image_sizes
        return inputs


def pad_left(prompts: List[List[int]], pad_token_id: int):
    """What the tokenizer does with padding_side="left": ids and attention_mask."""
    max_len = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), max_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), max_len), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, max_len - len(p):] = torch.tensor(p)
        attention_mask[i, max_len - len(p):] = 1
    return input_ids, attention_mask


def main():
    torch.manual_seed(0)
    vision_cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      image_size=16, patch_size=4, num_channels=3)
    config = LlavaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    config.mm_vision_tower = vision_cfg
    config.mm_vision_select_layer = -2
    config.mm_vision_select_feature = "patch"
    config.mm_projector_type = "mlp2x_gelu"
    config.mm_hidden_size = vision_cfg["hidden_size"]
    config.tokenizer_padding_side = "left"
    config._attn_implementation = "sdpa"
    model = LlavaLlamaForCausalLM(config).eval()

    # USER: <image>\n<question> ASSISTANT:  (bos first, as tokenizer_image_token keeps it)
    prompts = [
        [1, 11, 12, IMAGE_TOKEN_INDEX, 13, 40, 41, 42, 20, 21],
        [1, 11, 12, IMAGE_TOKEN_INDEX, 13, IMAGE_TOKEN_INDEX, 13, 43, 20, 21],
        [1, 11, 12, IMAGE_TOKEN_INDEX, 13, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 20, 21],
    ]
    n_images = [1, 2, 1]
    pixel_values = torch.randn(sum(n_images), 3, 16, 16)
    per_prompt_images = torch.split(pixel_values, n_images, dim=0)

    gen_kwargs = dict(do_sample=False, max_new_tokens=6, min_new_tokens=6, use_cache=True, pad_token_id=0,
                      output_scores=True, return_dict_in_generate=True)

    input_ids, attention_mask = pad_left(prompts, pad_token_id=0)
    with torch.inference_mode():
        batched = model.generate(input_ids, images=pixel_values, attention_mask=attention_mask, **gen_kwargs)

    for i, prompt in enumerate(prompts):
        ids, mask = pad_left([prompt], pad_token_id=0)
        with torch.inference_mode():
            alone = model.generate(ids, images=per_prompt_images[i], attention_mask=mask, **gen_kwargs)
        assert torch.equal(batched.sequences[i], alone.sequences[0]), (i, batched.sequences[i], alone.sequences[0])
        for step, (b_scores, a_scores) in enumerate(zip(batched.scores, alone.scores)):
            # min_new_tokens leaves eos at -inf in both runs; assert_close takes equal infinities as equal
            torch.testing.assert_close(b_scores[i], a_scores[0], atol=1e-4, rtol=0, msg=f"prompt {i}, step {step}")
        print(f"prompt {i}: {len(prompt)} ids, {n_images[i]} image(s) -> {batched.sequences[i].tolist()} (matches alone)")
    print("ok: left-padded batched generation equals each prompt generated alone")


if __name__ == "__main__":
    main()
