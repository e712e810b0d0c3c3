# huggingface/transformers#40490 ("[qwen-vl] fix position ids", fixes issues #40136 and #40154), in v4.57.0;
# the code before it is v4.56.1's Qwen2_5_VLForConditionalGeneration.prepare_inputs_for_generation.
#
# Qwen2.5-VL prepares its 3D (mRoPE) position ids for generation itself. At prefill it runs get_rope_index, which
# also stores per-row rope_deltas = max_position + 1 - padded_length (so a left-padded row's delta already takes
# its pad count off). Before the fix, decode steps took the position_ids that the generic
# GenerationMixin.prepare_inputs_for_generation had made from the attention mask (cumsum(mask) - 1, which already
# skips the pads) and added rope_deltas to them, so a left-padded row's decode positions were moved back by the
# pad count a second time. The fix builds decode positions as arange(seq_len) + cache_position[0] + rope_deltas,
# as the model's own forward does, and keeps the cumsum positions only as the 4th "text" row.
#
# Ported (text-only prompts, no pixel values) with the model's text stack taken from transformers
# (Qwen2_5_VLTextModel, which splits the [4, bs, seq] position ids into text + mRoPE rows) and a greedy decode loop
# that calls prepare_inputs_for_generation as generate() does. `python FILE` runs v4.56.1's code, `--fixed` v4.57.0's.
import sys

import torch
from torch import nn

from transformers import DynamicCache
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

FIXED = "--fixed" in sys.argv


class Qwen2_5_VLForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.language_model = Qwen2_5_VLTextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope_deltas = None  # cache rope_deltas here

    # Qwen2_5_VLModel.get_rope_index, the branch taken without image_grid_thw / video_grid_thw (v4.56.1)
    def get_rope_index(self, input_ids=None, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None,
                       attention_mask=None):
        if attention_mask is not None:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1).to(attention_mask.device)
            max_position_ids = position_ids.max(0, keepdim=False)[0].max(-1, keepdim=True)[0]
            mrope_position_deltas = max_position_ids + 1 - attention_mask.shape[-1]
        else:
            position_ids = (
                torch.arange(input_ids.shape[1], device=input_ids.device)
                .view(1, 1, -1)
                .expand(3, input_ids.shape[0], -1)
            )
            mrope_position_deltas = torch.zeros(
                [input_ids.shape[0], 1],
                device=input_ids.device,
                dtype=input_ids.dtype,
            )
        return position_ids, mrope_position_deltas

    # GenerationMixin.prepare_inputs_for_generation (v4.56.1), the parts a decoder-only model with a cache uses
    def _generic_prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                               cache_position=None, **kwargs):
        model_inputs = {"cache_position": cache_position, "past_key_values": past_key_values}
        if past_key_values is not None:
            input_ids = input_ids[:, cache_position]
        model_inputs["input_ids"] = input_ids.clone(memory_format=torch.contiguous_format)
        # 4. Create missing `position_ids` on the fly
        if attention_mask is not None and kwargs.get("position_ids") is None:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            kwargs["position_ids"] = position_ids
        for model_input_name in ["position_ids"]:
            model_input = kwargs.get(model_input_name)
            if model_input is not None:
                if past_key_values is not None:
                    current_input_length = model_inputs["input_ids"].shape[1]
                    model_input = model_input[:, -current_input_length:]
                    model_input = model_input.clone(memory_format=torch.contiguous_format)
                model_inputs[model_input_name] = model_input
        model_inputs["attention_mask"] = attention_mask
        return model_inputs

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      cache_position=None, position_ids=None, image_grid_thw=None,
                                      video_grid_thw=None, second_per_grid_ts=None):
        model_inputs = self._generic_prepare_inputs_for_generation(
            input_ids, past_key_values=past_key_values, attention_mask=attention_mask,
            cache_position=cache_position, position_ids=position_ids,
        )

        # Qwen2-5-VL position_ids are prepared with rope_deltas
        if position_ids is None:
            if cache_position[0] == 0 or self.rope_deltas is None:
                vision_positions, rope_deltas = self.get_rope_index(
                    model_inputs.get("input_ids", None),
                    image_grid_thw=image_grid_thw,
                    video_grid_thw=video_grid_thw,
                    second_per_grid_ts=second_per_grid_ts,
                    attention_mask=attention_mask,
                )
                self.rope_deltas = rope_deltas
            # then use the prev pre-calculated rope-deltas to get the correct position ids
            elif "position_ids" in model_inputs:
                if FIXED:
                    batch_size, seq_length = model_inputs["position_ids"].shape
                    device = model_inputs["position_ids"].device
                    position_ids = torch.arange(seq_length, device=device)
                    position_ids = position_ids.view(1, 1, -1).expand(3, batch_size, -1)
                    delta = cache_position[0] + self.rope_deltas
                    delta = delta.repeat_interleave(batch_size // delta.shape[0], dim=0)
                    vision_positions = position_ids + delta.expand_as(position_ids)
                else:
                    position_ids = model_inputs["position_ids"][None, ...]
                    delta = self.rope_deltas
                    delta = delta.repeat_interleave(position_ids.shape[1] // delta.shape[0], dim=0)
                    vision_positions = position_ids + delta.expand_as(position_ids)
                    vision_positions = vision_positions.expand(3, vision_positions.shape[1], -1)

            # Concatenate "text + vision" positions into [4, bs, seq-len]
            text_positions = model_inputs["position_ids"][None, ...]
            model_inputs["position_ids"] = torch.cat([text_positions, vision_positions], dim=0)

        return model_inputs

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                cache_position=None):
        outputs = self.language_model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=past_key_values,
            use_cache=True,
        )
        return self.lm_head(outputs.last_hidden_state)


def greedy_generate(model, input_ids, attention_mask, max_new_tokens):
    past_key_values = DynamicCache(config=model.config)
    cache_position = torch.arange(input_ids.shape[1])
    for _ in range(max_new_tokens):
        model_inputs = model.prepare_inputs_for_generation(
            input_ids, past_key_values=past_key_values, attention_mask=attention_mask, cache_position=cache_position
        )
        logits = model(
            input_ids=model_inputs["input_ids"],
            attention_mask=model_inputs["attention_mask"],
            position_ids=model_inputs["position_ids"],
            past_key_values=past_key_values,
        )
        next_tokens = logits[:, -1, :].argmax(-1)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        cache_position = cache_position[-1:] + 1
    return input_ids


def main():
    torch.manual_seed(0)
    config = Qwen2_5_VLTextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    config._attn_implementation = "sdpa"
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)

    # processor(padding_side="left") for a batch of two prompts of different lengths
    pad = config.pad_token_id
    prompts = [[17, 45, 92, 33, 8, 71, 120, 54, 3, 201, 99, 12], [64, 150, 27, 9, 211]]
    max_len = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (max_len - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])

    with torch.no_grad():
        out = greedy_generate(model, input_ids, attention_mask, max_new_tokens=8)
    for row in out[:, max_len:].tolist():
        print(row)


if __name__ == "__main__":
    main()
