# huggingface/transformers#34305 (fixes #33976 and #33662): "Fix right padding in LLaVA models"; code read in 4.45.2 (before) and 4.47.0 (after)
# VideoLlavaForConditionalGeneration._merge_input_ids_with_visual_features: with right padding and rows holding a different
# number of <video> tokens, `image_to_overwrite &= cumsum - 1 >= nb_image_pad` dropped the first video slots of the shorter
# row and marked trailing pad slots instead; `final_attention_mask |= image_to_overwrite` then un-masked pad and masked video.
import sys

import torch
import torch.nn as nn
from transformers import CLIPVisionModel, LlamaForCausalLM, VideoLlavaConfig
from transformers.activations import ACT2FN

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class VideoLlavaMultiModalProjector(nn.Module):
    def __init__(self, config: VideoLlavaConfig):
        super().__init__()

        self.linear_1 = nn.Linear(config.vision_config.hidden_size, config.text_config.hidden_size, bias=True)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(config.text_config.hidden_size, config.text_config.hidden_size, bias=True)

    def forward(self, image_features):
        hidden_states = self.linear_1(image_features)
        hidden_states = self.act(hidden_states)
        hidden_states = self.linear_2(hidden_states)
        return hidden_states


class VideoLlavaForConditionalGeneration(nn.Module):
    def __init__(self, config: VideoLlavaConfig):
        super().__init__()
        self.config = config
        self.video_tower = CLIPVisionModel(config.vision_config)
        self.multi_modal_projector = VideoLlavaMultiModalProjector(config)
        self.vocab_size = config.text_config.vocab_size
        self.language_model = LlamaForCausalLM(config.text_config)
        self.pad_token_id = self.config.pad_token_id if self.config.pad_token_id is not None else -1

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def _merge_input_ids_with_visual_features(
        self, visual_features, inputs_embeds, input_ids, attention_mask, labels, num_frames=1
    ):
        num_images, num_image_patches, embed_dim = visual_features.shape
        batch_size, sequence_length = input_ids.shape
        left_padding = not torch.sum(input_ids[:, -1] == torch.tensor(self.pad_token_id))
        special_vision_token = self.config.video_token_index if num_frames > 1 else self.config.image_token_index

        # 1. Create a mask to know where special image tokens are
        special_image_token_mask = input_ids == special_vision_token
        num_special_image_tokens = torch.sum(special_image_token_mask, dim=-1)
        # Compute the maximum embed dimension
        max_seq_len = (num_special_image_tokens.max() * (num_image_patches * num_frames - 1)) + sequence_length
        batch_indices, non_image_indices = torch.where(input_ids != special_vision_token)

        # 2. Compute the positions where text should be written
        new_token_positions = (
            torch.cumsum((special_image_token_mask * (num_image_patches * num_frames - 1) + 1), dim=-1) - 1
        )
        nb_image_pad = max_seq_len - 1 - new_token_positions[:, -1]
        if left_padding:
            new_token_positions += nb_image_pad[:, None]  # offset for left padding
        text_to_overwrite = new_token_positions[batch_indices, non_image_indices]

        # 3. Create the full embedding, already padded to the maximum position
        final_embedding = torch.zeros(
            batch_size, max_seq_len, embed_dim, dtype=inputs_embeds.dtype, device=inputs_embeds.device
        )
        final_attention_mask = torch.zeros(
            batch_size, max_seq_len, dtype=attention_mask.dtype, device=inputs_embeds.device
        )
        final_input_ids = torch.full(
            (batch_size, max_seq_len), self.pad_token_id, dtype=input_ids.dtype, device=inputs_embeds.device
        )
        target_device = inputs_embeds.device
        batch_indices, non_image_indices, text_to_overwrite = (
            batch_indices.to(target_device),
            non_image_indices.to(target_device),
            text_to_overwrite.to(target_device),
        )
        attention_mask = attention_mask.to(target_device)

        # 4. Fill the embeddings based on the mask.
        final_embedding[batch_indices, text_to_overwrite] = inputs_embeds[batch_indices, non_image_indices]
        final_attention_mask[batch_indices, text_to_overwrite] = attention_mask[batch_indices, non_image_indices]
        final_input_ids[batch_indices, text_to_overwrite] = input_ids[batch_indices, non_image_indices]
        if labels is not None:
            final_labels = torch.full(
                (batch_size, max_seq_len), self.config.ignore_index, dtype=input_ids.dtype, device=input_ids.device
            )
            final_labels[batch_indices, text_to_overwrite] = labels[batch_indices, non_image_indices]
        else:
            final_labels = None

        # 5. Fill the embeddings corresponding to the images. Anything that is still zeros needs filling
        image_to_overwrite = torch.full((batch_size, max_seq_len), True, dtype=torch.bool, device=inputs_embeds.device)
        image_to_overwrite[batch_indices, text_to_overwrite] = False
        if FIXED:
            if left_padding:
                image_to_overwrite &= image_to_overwrite.cumsum(-1) - 1 >= nb_image_pad[:, None].to(target_device)
            else:
                mask = torch.ones_like(image_to_overwrite, dtype=torch.bool).cumsum(-1) - 1
                padding_mask = mask <= new_token_positions[:, -1:].to(target_device)
                image_to_overwrite &= padding_mask
        else:
            image_to_overwrite &= image_to_overwrite.cumsum(-1) - 1 >= nb_image_pad[:, None].to(target_device)

        if image_to_overwrite.sum() != visual_features.shape[:-1].numel():
            raise ValueError("The input provided to the model are wrong.")

        final_embedding[image_to_overwrite] = visual_features.contiguous().reshape(-1, embed_dim).to(target_device)
        final_attention_mask |= image_to_overwrite
        position_ids = (final_attention_mask.cumsum(-1) - 1).masked_fill_((final_attention_mask == 0), 1)

        return final_embedding, final_attention_mask, final_labels, position_ids, final_input_ids

    def _get_vision_features(self, pixel_values_videos, vision_feature_layer):
        # videos do not need to select features and it's always "full" (as it is done in the orig implementation)
        batch_size_vid, num_frames, channels, height, width = pixel_values_videos.shape
        pixel_values = pixel_values_videos.reshape(batch_size_vid * num_frames, channels, height, width)
        video_outputs = self.video_tower(pixel_values, output_hidden_states=True)
        video_outputs = video_outputs.hidden_states[vision_feature_layer].squeeze(1)
        return video_outputs, num_frames

    def forward(self, input_ids, pixel_values_videos, attention_mask, labels):
        vision_feature_layer = self.config.vision_feature_layer
        inputs_embeds = self.get_input_embeddings()(input_ids)

        video_outputs, num_frames = self._get_vision_features(pixel_values_videos, vision_feature_layer)
        video_features = self.multi_modal_projector(video_outputs)

        inputs_embeds, attention_mask, labels, position_ids, input_ids = self._merge_input_ids_with_visual_features(
            video_features, inputs_embeds, input_ids, attention_mask, labels, num_frames=num_frames
        )

        outputs = self.language_model(
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
        )
        logits = outputs[0]

        shift_attention_mask = attention_mask[..., 1:]
        shift_logits = logits[..., :-1, :][shift_attention_mask.to(logits.device) != 0].contiguous()
        shift_labels = labels[..., 1:][shift_attention_mask.to(labels.device) != 0].contiguous()
        loss_fct = nn.CrossEntropyLoss()
        loss = loss_fct(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1).to(shift_logits.device))
        return loss, logits


config = VideoLlavaConfig(
    vision_config=dict(
        model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, image_size=16, patch_size=8,
    ),
    text_config=dict(
        model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, pad_token_id=0,
    ),
    image_token_index=126,
    video_token_index=127,
    vision_feature_layer=-2,
    pad_token_id=0,
    ignore_index=-100,
)
config.text_config._attn_implementation = "sdpa"
config.vision_config._attn_implementation = "sdpa"

model = VideoLlavaForConditionalGeneration(config)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

V, P = config.video_token_index, config.pad_token_id
# training batch, right padded: row 0 holds one clip, row 1 holds two
input_ids = torch.tensor([
    [1, 5, 6, V, 7, 8, 9, P, P, P, P],
    [1, 5, 6, V, 10, 11, V, 12, 13, 14, 15],
])
attention_mask = (input_ids != P).long()
labels = input_ids.masked_fill(attention_mask == 0, config.ignore_index).masked_fill(input_ids == V, config.ignore_index)
pixel_values_videos = torch.randn(3, 2, 3, 16, 16)  # three clips of two frames

loss, logits = model(input_ids, pixel_values_videos, attention_mask, labels)
loss.backward()
optimizer.step()
print(f"loss {loss.item():.5f}")
