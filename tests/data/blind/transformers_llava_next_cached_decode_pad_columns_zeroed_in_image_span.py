# Citation: huggingface/transformers#29850 ("Better llava next."), which names this line of
# LlavaNextForConditionalGeneration.forward as wrong for left-padded batched generation; code read in the
# transformers 4.39.3 wheel (before) and the 4.40.0 wheel (after), src/transformers/models/llava_next/modeling_llava_next.py.
#
# LLaVA-NeXT merges each <image> token into its image features inside forward, so the 2-D attention_mask that
# generate() carries is in text space while the KV cache is in merged space. On each cached decode step the model
# rebuilds the mask: it finds the left-pad columns of the cache (their keys are all zero) and builds the missing
# columns. Before the fix it built only `target_seqlen - attention_mask.shape[1]` columns, zeroed the pad indices
# *inside those extra columns* and appended them after generate()'s text mask; so a left-padded row masks real
# image/text keys near the end of its prompt. After the fix (4.40.0) the rebuilt mask covers the whole past and is
# followed by the new token's column.
import sys

import torch
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM, LlavaNextConfig
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class LlavaNextMultiModalProjector(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear_1 = nn.Linear(config.vision_config.hidden_size, config.text_config.hidden_size, bias=True)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(config.text_config.hidden_size, config.text_config.hidden_size, bias=True)

    def forward(self, image_features):
        hidden_states = self.linear_1(image_features)
        hidden_states = self.act(hidden_states)
        hidden_states = self.linear_2(hidden_states)
        return hidden_states


class LlavaNextForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.vision_tower = CLIPVisionModel(config.vision_config)
        self.multi_modal_projector = LlavaNextMultiModalProjector(config)
        embed_std = 1 / (config.text_config.hidden_size**0.5)
        self.image_newline = nn.Parameter(torch.randn(config.text_config.hidden_size) * embed_std)
        self.vocab_size = config.text_config.vocab_size
        self.language_model = LlamaForCausalLM(config.text_config)
        self.pad_token_id = self.config.pad_token_id if self.config.pad_token_id is not None else -1

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def _merge_input_ids_with_image_features(self, image_features, inputs_embeds, input_ids, attention_mask, labels):
        num_images, num_image_patches, embed_dim = image_features.shape
        batch_size, sequence_length = input_ids.shape
        left_padding = not torch.sum(input_ids[:, -1] == torch.tensor(self.pad_token_id))
        # 1. Create a mask to know where special image tokens are
        special_image_token_mask = input_ids == self.config.image_token_index
        num_special_image_tokens = torch.sum(special_image_token_mask, dim=-1)
        # Compute the maximum embed dimension
        max_embed_dim = (num_special_image_tokens.max() * (num_image_patches - 1)) + sequence_length
        batch_indices, non_image_indices = torch.where(input_ids != self.config.image_token_index)

        # 2. Compute the positions where text should be written
        new_token_positions = torch.cumsum((special_image_token_mask * (num_image_patches - 1) + 1), -1) - 1
        nb_image_pad = max_embed_dim - 1 - new_token_positions[:, -1]
        if left_padding:
            new_token_positions += nb_image_pad[:, None]  # offset for left padding
        text_to_overwrite = new_token_positions[batch_indices, non_image_indices]

        # 3. Create the full embedding, already padded to the maximum position
        final_embedding = torch.zeros(
            batch_size, max_embed_dim, embed_dim, dtype=inputs_embeds.dtype, device=inputs_embeds.device
        )
        final_attention_mask = torch.zeros(
            batch_size, max_embed_dim, dtype=attention_mask.dtype, device=inputs_embeds.device
        )
        if labels is not None:
            final_labels = torch.full(
                (batch_size, max_embed_dim), self.config.ignore_index, dtype=input_ids.dtype, device=input_ids.device
            )
        target_device = inputs_embeds.device
        attention_mask = attention_mask.to(target_device)

        # 4. Fill the embeddings based on the mask.
        final_embedding[batch_indices, text_to_overwrite] = inputs_embeds[batch_indices, non_image_indices]
        final_attention_mask[batch_indices, text_to_overwrite] = attention_mask[batch_indices, non_image_indices]
        if labels is not None:
            final_labels[batch_indices, text_to_overwrite] = labels[batch_indices, non_image_indices]

        # 5. Fill the embeddings corresponding to the images. Anything that is still zeros needs filling
        image_to_overwrite = torch.all(final_embedding == 0, dim=-1)
        image_to_overwrite &= image_to_overwrite.cumsum(-1) - 1 >= nb_image_pad[:, None].to(target_device)

        if image_to_overwrite.sum() != image_features.shape[:-1].numel():
            raise ValueError("The input provided to the model are wrong.")

        final_embedding[image_to_overwrite] = image_features.contiguous().reshape(-1, embed_dim).to(target_device)
        final_attention_mask |= image_to_overwrite
        position_ids = (final_attention_mask.cumsum(-1) - 1).masked_fill_((final_attention_mask == 0), 1)

        # 6. Mask out the embedding at padding positions, as we later use the past_key_value value to determine the non-attended tokens.
        batch_indices, pad_indices = torch.where(input_ids == self.pad_token_id)
        indices_to_mask = new_token_positions[batch_indices, pad_indices]

        final_embedding[batch_indices, indices_to_mask] = 0

        if labels is None:
            final_labels = None

        return final_embedding, final_attention_mask, final_labels, position_ids

    def forward(self, input_ids=None, pixel_values=None, image_sizes=None, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=True):
        vision_feature_layer = self.config.vision_feature_layer
        vision_feature_select_strategy = self.config.vision_feature_select_strategy

        # 1. Extract the input embeddings
        inputs_embeds = self.get_input_embeddings()(input_ids)

        # 2. Merge text and images
        if pixel_values is not None and input_ids.shape[1] != 1:
            batch_size, num_patches, num_channels, height, width = pixel_values.shape
            reshaped_pixel_values = pixel_values.view(batch_size * num_patches, num_channels, height, width)
            image_features = self.vision_tower(reshaped_pixel_values, output_hidden_states=True)

            selected_image_feature = image_features.hidden_states[vision_feature_layer]

            if vision_feature_select_strategy == "default":
                selected_image_feature = selected_image_feature[:, 1:]
            elif vision_feature_select_strategy == "full":
                selected_image_feature = selected_image_feature

            image_features = self.multi_modal_projector(selected_image_feature)

            split_sizes = [image.shape[0] for image in pixel_values]
            image_features = torch.split(image_features, split_sizes, dim=0)

            new_image_features = []
            for image_idx, image_feature in enumerate(image_features):
                # a single (base) crop per image: no anyres grid to unpad
                image_feature = image_feature[0]
                image_feature = torch.cat((image_feature, self.image_newline[None]), dim=0)
                new_image_features.append(image_feature)
            image_features = torch.stack(new_image_features, dim=0)

            inputs_embeds, attention_mask, labels, position_ids = self._merge_input_ids_with_image_features(
                image_features, inputs_embeds, input_ids, attention_mask, None
            )

        # In case input_ids.shape[1] == 1 & pixel_values==None & past_key_values != None, we are in the case of
        # generation with cache
        elif past_key_values is not None and pixel_values is not None and input_ids.shape[1] == 1:
            # Retrieve the first layer to inspect the logits and mask out the hidden states
            # that are set to 0
            first_layer_past_key_value = past_key_values.layers[0].keys[:, :, :, 0]

            # Sum all dimensions of head_dim (-2) to avoid random errors
            batch_index, non_attended_tokens = torch.where(first_layer_past_key_value.float().sum(-2) == 0)

            if FIXED:
                # Get the target length
                target_length = input_ids.shape[1]
                past_length = first_layer_past_key_value.shape[-1]

                extended_attention_mask = torch.ones(
                    (attention_mask.shape[0], past_length),
                    dtype=attention_mask.dtype,
                    device=attention_mask.device,
                )
            else:
                # Get the target length
                target_seqlen = first_layer_past_key_value.shape[-1] + 1

                extended_attention_mask = torch.ones(
                    (attention_mask.shape[0], target_seqlen - attention_mask.shape[1]),
                    dtype=attention_mask.dtype,
                    device=attention_mask.device,
                )

            # Filter out only the tokens that can be un-attended
            valid_indices = non_attended_tokens < extended_attention_mask.size(-1)
            new_batch_index = batch_index[valid_indices]
            new_non_attended_tokens = non_attended_tokens[valid_indices]

            # Zero-out the places where we don't need to attend
            extended_attention_mask[new_batch_index, new_non_attended_tokens] = 0

            if FIXED:
                attention_mask = torch.cat((extended_attention_mask, attention_mask[:, -target_length:]), dim=1)
            else:
                attention_mask = torch.cat((attention_mask, extended_attention_mask), dim=1)
            position_ids = torch.sum(attention_mask, dim=1).unsqueeze(-1) - 1

        outputs = self.language_model(
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=past_key_values,  # transformers 5 name of the `past_key_values` argument
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        return outputs

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, pixel_values=None, image_sizes=None,
                                      attention_mask=None):
        if past_key_values is not None:
            past_length = past_key_values.get_seq_length()
            if attention_mask is not None and attention_mask.shape[1] > input_ids.shape[1]:
                input_ids = input_ids[:, -(attention_mask.shape[1] - past_length):]
            elif past_length < input_ids.shape[1]:
                input_ids = input_ids[:, past_length:]
            elif self.config.image_token_index in input_ids:
                input_ids = input_ids[:, input_ids.shape[1] - 1:]

        position_ids = None
        if attention_mask is not None:
            # create position_ids on the fly for batch generation
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            if past_key_values is not None:
                position_ids = position_ids[:, -input_ids.shape[1]:]

        return {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "past_key_values": past_key_values,
            "attention_mask": attention_mask,
            "pixel_values": pixel_values,
            "image_sizes": image_sizes,
        }

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, pixel_values, image_sizes, max_new_tokens):
        # greedy search as GenerationMixin runs it: the 2-D text mask grows by one column per new token
        past_key_values = DynamicCache()
        for _ in range(max_new_tokens):
            model_inputs = self.prepare_inputs_for_generation(
                input_ids, past_key_values=past_key_values if past_key_values.get_seq_length() > 0 else None,
                pixel_values=pixel_values, image_sizes=image_sizes, attention_mask=attention_mask,
            )
            if model_inputs["past_key_values"] is None:
                model_inputs["past_key_values"] = past_key_values
            outputs = self.forward(**model_inputs)
            next_tokens = outputs.logits[:, -1, :].argmax(-1)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        return input_ids


vision_config = CLIPVisionConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    image_size=16, patch_size=4, num_channels=3,
)
text_config = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
)
config = LlavaNextConfig(
    vision_config=vision_config, text_config=text_config, image_token_index=63,
    vision_feature_select_strategy="default", vision_feature_layer=-2,
    image_grid_pinpoints=[[16, 16]],
)
config.pad_token_id = 0
config.ignore_index = -100
model = LlavaNextForConditionalGeneration(config).eval()
# as in the released llava-hf checkpoints, the <pad> row of the embedding table is a trained (non-zero) vector
with torch.no_grad():
    model.get_input_embeddings().weight.normal_(std=0.02)

# processor output for two prompts "[INST] <image>\n... [/INST]", tokenizer.padding_side = "left"
IMG, PAD = 63, 0
input_ids = torch.tensor([
    [1, 5, IMG, 7, 9, 11, 13, 15, 17, 19, 21, 23],
    [PAD, PAD, PAD, PAD, 1, 5, IMG, 8, 10, 12, 14, 16],
])
attention_mask = (input_ids != PAD).long()
pixel_values = torch.randn(2, 1, 3, 16, 16)
image_sizes = torch.tensor([[16, 16], [16, 16]])

out = model.generate(input_ids, attention_mask, pixel_values, image_sizes, max_new_tokens=6)
print("generated:", out[:, input_ids.shape[1]:].tolist())
