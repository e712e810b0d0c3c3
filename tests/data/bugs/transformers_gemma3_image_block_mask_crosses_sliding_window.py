# huggingface/transformers#46850: Gemma3Model OR'ed the bidirectional image-token mask (token_type_ids) on top of the
# sliding-window causal mask, so on local layers image tokens attended to image tokens outside the sliding window.
import sys

import torch
from torch import nn
from transformers import Gemma3TextConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3TextModel,
    create_masks_for_vision_model,
    get_block_sequence_ids_for_mask,
)

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def token_type_ids_mask_function(token_type_ids, image_group_ids):
    """The `or` mask function Gemma3Model passed for image tokens before the fix."""

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        safe_q_idx = torch.where(q_idx < token_type_ids.shape[1], q_idx, 0)
        safe_kv_idx = torch.where(kv_idx < token_type_ids.shape[1], kv_idx, 0)
        token_type_ids_at_q_idx = torch.where(q_idx < token_type_ids.shape[1], token_type_ids[batch_idx, safe_q_idx], 0)
        token_type_ids_at_kv_idx = torch.where(kv_idx < token_type_ids.shape[1], token_type_ids[batch_idx, safe_kv_idx], 0)
        image_group_ids_at_q_idx = torch.where(q_idx < image_group_ids.shape[1], image_group_ids[batch_idx, safe_q_idx], -1)
        image_group_ids_at_kv_idx = torch.where(kv_idx < image_group_ids.shape[1], image_group_ids[batch_idx, safe_kv_idx], -1)
        is_image_block = (token_type_ids_at_q_idx == 1) & (token_type_ids_at_kv_idx == 1)
        same_image_block = image_group_ids_at_q_idx == image_group_ids_at_kv_idx
        return is_image_block & same_image_block

    return inner_mask


def create_causal_mask_mapping(config, inputs_embeds, attention_mask, position_ids, token_type_ids):
    mask_kwargs = {
        "config": config,
        "inputs_embeds": inputs_embeds,
        "attention_mask": attention_mask,
        "cache": None,
        "position_ids": position_ids,
    }
    if FIXED:
        block_sequence_ids = get_block_sequence_ids_for_mask(token_type_ids, device=inputs_embeds.device)
        return create_masks_for_vision_model(block_sequence_ids=block_sequence_ids, **mask_kwargs)
    # The images cannot attend to future images, but can attend to all prev images and to itself bidirectionally
    is_image = token_type_ids == 1
    new_image_start = is_image & ~nn.functional.pad(is_image, (1, 0), value=0)[:, :-1]
    image_group_ids = torch.cumsum(new_image_start.int(), dim=1) - 1
    image_group_ids = torch.where(is_image, image_group_ids, torch.full_like(token_type_ids, -1))
    mask_kwargs["or_mask_function"] = token_type_ids_mask_function(token_type_ids, image_group_ids)
    return {
        "full_attention": create_causal_mask(**mask_kwargs),
        "sliding_attention": create_sliding_window_causal_mask(**mask_kwargs),
    }


config = Gemma3TextConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, sliding_window=3, max_position_embeddings=64,
    layer_types=["sliding_attention", "full_attention"], attn_implementation="sdpa",
)
language_model = Gemma3TextModel(config).eval()

# text, <start_of_image>, 8 image soft tokens, <end_of_image>, text
image_token_id = 5
input_ids = torch.tensor([[2, 10, 11, 12, 3] + [image_token_id] * 8 + [4, 13, 14, 15]])
token_type_ids = (input_ids == image_token_id).long()
attention_mask = torch.ones_like(input_ids)
position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)

with torch.no_grad():
    inputs_embeds = language_model.embed_tokens(input_ids)
    image_features = torch.randn(1, 8, config.hidden_size)  # stands in for vision_tower + multi_modal_projector
    special_image_mask = (input_ids == image_token_id).unsqueeze(-1).expand_as(inputs_embeds)
    inputs_embeds = inputs_embeds.masked_scatter(special_image_mask, image_features)

    causal_mask_mapping = create_causal_mask_mapping(config, inputs_embeds, attention_mask, position_ids, token_type_ids)
    out = language_model(inputs_embeds=inputs_embeds, attention_mask=causal_mask_mapping,
                         position_ids=position_ids).last_hidden_state

print(f"fixed={FIXED} hidden[last image token, :4] = {[round(v, 4) for v in out[0, 12, :4].tolist()]}")
