"""Gemma3 multimodal mask: every image token attends every other image token, future images included.

Citation: huggingface/transformers#38053 (issue), fixed by huggingface/transformers#38080
("[gemma3] fix bidirectional attention mask").

Bug: ``Gemma3ForConditionalGeneration._update_causal_mask`` un-masks the causal mask wherever query and
key are both image tokens: ``token_type_mask = token_type_ids.unsqueeze(1) == token_type_ids.unsqueeze(2)``
with text rows cleared. With two images in one prompt the first image's tokens attend the second
image's tokens, which come later in the sequence ("images cannot attend to future images but in current
implementation we unmask attention within all images").
Fix: give each contiguous run of image tokens a group id (cumsum over image starts) and un-mask only
query/key pairs inside the same image.

This program: a one-layer Gemma3-style text decoder (SDPA with the 4D additive mask) fed a batch of two
prompts of 12 tokens with ``token_type_ids`` marking two images of 3 tokens each, the second prompt
left-padded by 2 (``attention_mask``). With the bug, the tokens of image 1 see image 2.
"""
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Gemma3TextConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    vocab_size: int = 64
    _attn_implementation: str = "sdpa"


@dataclass
class Gemma3Config:
    text_config: Gemma3TextConfig = field(default_factory=Gemma3TextConfig)
    image_token_index: int = 63
    mm_tokens_per_image: int = 3


class Gemma3Attention(nn.Module):
    def __init__(self, config: Gemma3TextConfig):
        super().__init__()
        self.config = config
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, -1, self.config.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        k = k.repeat_interleave(self.num_key_value_groups, dim=1)
        v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class Gemma3ForConditionalGeneration(nn.Module):
    def __init__(self, config: Gemma3Config):
        super().__init__()
        self.config = config
        self.dtype = torch.float32
        self.embed_tokens = nn.Embedding(config.text_config.vocab_size, config.text_config.hidden_size)
        self.self_attn = Gemma3Attention(config.text_config)

    def _update_causal_mask(self, attention_mask, token_type_ids, past_key_values, cache_position, input_tensor):
        if self.config.text_config._attn_implementation == "flash_attention_2":
            return attention_mask

        if attention_mask is not None and attention_mask.dim() == 4:
            # In this case we assume that the mask comes already in inverted form
            return attention_mask

        min_dtype = torch.finfo(self.dtype).min
        inputs_lead_dim, sequence_length = input_tensor.shape[:2]
        target_length = (
            attention_mask.shape[-1]
            if isinstance(attention_mask, torch.Tensor)
            else cache_position[0] + sequence_length + 1
        )

        causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=self.dtype)
        # Causal diagonal mask only if training, otherwise attend to the whole prefix.
        if sequence_length != 1:
            causal_mask = torch.triu(causal_mask, diagonal=1)

        causal_mask *= torch.arange(target_length) > cache_position.reshape(-1, 1)
        causal_mask = causal_mask[None, None, :, :].expand(inputs_lead_dim, 1, -1, -1)

        # Apply bidirectional mask on images if token type ids are provided
        if token_type_ids is not None and sequence_length != 1:
            if FIXED:
                # The images cannot attend to future images, but can attend to all prev images and to
                # itself bidirectionally
                is_image = token_type_ids == 1
                padded = nn.functional.pad(is_image, (1, 0), value=0)
                new_image_start = is_image & ~padded[:, :-1]
                image_group_id = torch.cumsum(new_image_start.int(), dim=1) - 1
                image_group_positions = torch.where(is_image, image_group_id, torch.full_like(token_type_ids, -1))
                token_type_mask = (image_group_positions.unsqueeze(1) == image_group_positions.unsqueeze(2)) & (
                    image_group_positions.unsqueeze(1) != -1
                )
            else:
                token_type_mask = token_type_ids.unsqueeze(1) == token_type_ids.unsqueeze(2)
                token_type_mask[token_type_ids == 0] = False  # if text token do not change anything
            token_type_mask = token_type_mask.unsqueeze(1).to(dtype=torch.bool)
            causal_mask = causal_mask.clone()
            causal_mask[:, :, :, :sequence_length] = causal_mask[:, :, :, :sequence_length].masked_fill(
                token_type_mask, 0.0
            )

        if attention_mask is not None:
            causal_mask = causal_mask.clone()  # copy to contiguous memory for in-place edit
            mask_length = attention_mask.shape[-1]
            # Then apply padding mask (will mask pad tokens)
            padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :]
            padding_mask = padding_mask == 0
            causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(
                padding_mask, min_dtype
            )
        return causal_mask

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, past_key_values=None):
        inputs_embeds = self.embed_tokens(input_ids)
        cache_position = torch.arange(inputs_embeds.shape[1])
        causal_mask = self._update_causal_mask(
            attention_mask, token_type_ids, past_key_values, cache_position, inputs_embeds
        )
        return self.self_attn(inputs_embeds, causal_mask)


def main():
    torch.manual_seed(0)
    config = Gemma3Config()
    model = Gemma3ForConditionalGeneration(config).eval()
    img = config.image_token_index
    # <bos> text <img x3> text <img x3> text ; second prompt left-padded by 2 (pad id 0)
    input_ids = torch.tensor(
        [
            [2, 10, img, img, img, 11, 12, img, img, img, 13, 14],
            [0, 0, 2, 15, img, img, img, 16, img, img, img, 17],
        ]
    )
    attention_mask = (input_ids != 0).long()
    token_type_ids = (input_ids == img).long()
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    print("hidden", tuple(out.shape), "norm %.4f" % out.norm())


if __name__ == "__main__":
    main()
