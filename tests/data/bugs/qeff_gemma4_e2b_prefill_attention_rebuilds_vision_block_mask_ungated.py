# quic/efficient-transformers#1159 (commit 0dedfa5b6, "Gemma4 E2B vision and decoder fix", item 2).
#
# QEfficient's Gemma 4 port (QEfficient/transformers/models/gemma4/modeling_gemma4.py) builds its own
# additive masks. QEffGemma4TextModel.forward only drops its causal mask (so that the attention can build the
# image-block one) when `config.use_bidirectional_attention == "vision"`; for the other checkpoints (E2B / E4B,
# where the config leaves it unset) it hands every layer the plain causal mask. But
# QEffGemma4TextAttention.forward rebuilt the mask with _build_bidirectional_vision_attention_mask whenever
# `mm_token_type_ids` was passed on a prefill, with no look at the config, so on E2B / E4B the image
# placeholder tokens of a prompt attended to each other both ways (each image token saw the image tokens after
# it), unlike Hugging Face's Gemma 4 for those checkpoints.
# Fix: the attention rebuilds the mask only when `use_bidirectional_attention == "vision"` too.
#
# Trimmed to the prefill path (no KV cache, no per-layer embeddings), tiny random weights, an E2B-style text
# config (use_bidirectional_attention unset); the vision tower's output is a fixed random `vision_embeds`, as the
# dual-QPC decoder wrapper receives it. The QEff classes are swapped in over transformers' Gemma 4 modules the
# way QEfficient's module-mapping transform does it (by `__class__`).
import sys
from typing import Optional

import torch
import torch.nn as nn
from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4TextAttention,
    Gemma4TextDecoderLayer,
    Gemma4TextModel,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

FIXED = "--fixed" in sys.argv

_FP16_CLAMP_MIN = -65504.0


def _is_onnx_export() -> bool:
    return torch.onnx.is_in_onnx_export()


def _attention_mask_min(dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    # During export with -convert-to-fp16, using finfo(float32).min can create
    # extreme constants that destabilize downstream compiler passes.
    if _is_onnx_export():
        return torch.tensor(_FP16_CLAMP_MIN, dtype=dtype, device=device)
    return torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=device)


# QEfficient/transformers/modeling_attn_mask_utils.py
def _create_causal_mask(
    position_ids,
    target_length,
    sliding_window: Optional[int] = None,
    start_index: Optional[int] = 0,
):
    """
    A utility attention mask class that allows one to:
        - Create a causal 4d mask
        - Create a causal 4d mask with slided window
    """
    if sliding_window is not None:
        query_indices = position_ids.unsqueeze(-1)
        kv_indices = torch.arange(target_length).view(1, -1)
        # --- Rolling buffer ---
        pos_max = position_ids.max(1, keepdim=True).values
        kv_start = (pos_max // target_length) * target_length
        kv_indices_high = kv_indices + kv_start
        kv_indices_low = torch.where(kv_indices_high < target_length, kv_indices, kv_indices_high - target_length)
        kv_indices = torch.where(kv_indices_high > pos_max, kv_indices_low, kv_indices_high)
        kv_indices = kv_indices.unsqueeze(1)
        # ------
        causal_mask = kv_indices > query_indices
        attention_mask = causal_mask

        window_indices = query_indices - sliding_window + 1
        window_mask = kv_indices < window_indices
        attention_mask = attention_mask | window_mask
        attention_mask = attention_mask.unsqueeze(1)
    else:
        query_indices = position_ids.unsqueeze(-1)
        kv_indices = torch.arange(start=start_index, end=target_length).view(1, 1, -1)
        attention_mask = kv_indices > query_indices
        attention_mask = attention_mask.unsqueeze(1)

    return attention_mask


def _build_additive_attention_mask(
    position_ids: torch.Tensor,
    target_length,
    dtype: torch.dtype,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    causal_mask = _create_causal_mask(
        position_ids=position_ids,
        target_length=target_length,
        sliding_window=sliding_window,
    )
    return causal_mask.to(dtype=dtype) * _attention_mask_min(dtype, causal_mask.device)


def _build_bidirectional_vision_attention_mask(
    position_ids: torch.Tensor,
    mm_token_type_ids: Optional[torch.Tensor],
    target_length: int,
    dtype: torch.dtype,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """
    Export-safe eager attention mask that mirrors Gemma4's HF image-token semantics:
    vision tokens in the same contiguous image block attend bidirectionally, while all
    remaining tokens keep standard causal/sliding attention.
    """
    base_mask = _create_causal_mask(
        position_ids=position_ids,
        target_length=target_length,
        sliding_window=sliding_window,
    )
    if mm_token_type_ids is None:
        return base_mask.to(dtype=dtype) * _attention_mask_min(dtype, base_mask.device)

    is_vision = (mm_token_type_ids == 1) | (mm_token_type_ids == 2)
    is_prev_vision = torch.roll(is_vision, shifts=1, dims=-1)
    is_prev_vision[..., 0] = False
    new_vision_starts = is_vision & ~is_prev_vision
    vision_group_ids = torch.cumsum(new_vision_starts.to(torch.int64), dim=1) - 1
    vision_group_ids = torch.where(is_vision, vision_group_ids, torch.full_like(vision_group_ids, -1))

    kv_indices = torch.arange(target_length, device=vision_group_ids.device, dtype=torch.int64).view(1, -1)
    seq_len_limit = torch.full_like(kv_indices, vision_group_ids.shape[1] - 1)
    safe_kv_indices = torch.minimum(kv_indices, seq_len_limit)
    kv_group_ids = torch.gather(vision_group_ids, 1, safe_kv_indices.expand(vision_group_ids.shape[0], -1))
    kv_group_ids = torch.where(kv_indices < vision_group_ids.shape[1], kv_group_ids, torch.full_like(kv_group_ids, -1))

    same_group = (vision_group_ids.unsqueeze(-1) == kv_group_ids.unsqueeze(1)) & (vision_group_ids.unsqueeze(-1) >= 0)
    attention_mask = base_mask & ~same_group.unsqueeze(1)
    return attention_mask.to(dtype=dtype) * _attention_mask_min(dtype, attention_mask.device)


class QEffGemma4TextAttention(Gemma4TextAttention):
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        past_key_values=None,
        position_ids: Optional[torch.LongTensor] = None,
        mm_token_type_ids: Optional[torch.Tensor] = None,
        **kwargs,
    ):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        cos, sin = position_embeddings

        query_states = self.q_proj(hidden_states).view(hidden_shape)
        query_states = self.q_norm(query_states)
        query_states = apply_rotary_pos_emb(query_states, cos, sin, unsqueeze_dim=2)
        query_states = query_states.transpose(1, 2)

        key_states = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape) if self.v_proj is not None else key_states

        key_states = self.k_norm(key_states)
        key_states = apply_rotary_pos_emb(key_states, cos, sin, unsqueeze_dim=2)
        key_states = key_states.transpose(1, 2)

        value_states = self.v_norm(value_states)
        value_states = value_states.transpose(1, 2)

        if FIXED:
            rebuild = (
                mm_token_type_ids is not None
                and hidden_states.shape[1] != 1
                and getattr(self.config, "use_bidirectional_attention", None) == "vision"
            )
        else:
            rebuild = mm_token_type_ids is not None and hidden_states.shape[1] != 1
        if rebuild:
            attention_mask = _build_bidirectional_vision_attention_mask(
                position_ids=position_ids,
                mm_token_type_ids=mm_token_type_ids,
                target_length=key_states.shape[-2],
                dtype=query_states.dtype,
                sliding_window=self.sliding_window,
            )

        attn_output, attn_weights = eager_attention_forward(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class QEffGemma4TextDecoderLayer(Gemma4TextDecoderLayer):
    def forward(
        self,
        hidden_states: torch.Tensor,
        per_layer_input: torch.Tensor = None,
        position_embeddings: torch.Tensor = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states

        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            **kwargs,
        )
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        hidden_states = residual + hidden_states

        hidden_states *= self.layer_scalar
        return hidden_states


class QEffGemma4TextModel(Gemma4TextModel):
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values=None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        per_layer_inputs: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        if input_ids is not None:
            inputs_embeds = self.embed_tokens(input_ids)

        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)
            position_ids = position_ids.unsqueeze(0)

        hidden_states = inputs_embeds

        position_embeddings = {}
        for layer_type in self.unique_layer_types:
            position_embeddings[layer_type] = self.rotary_emb(hidden_states, position_ids, layer_type)

        for i, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            per_layer_input = per_layer_inputs[:, :, i, :] if per_layer_inputs is not None else None
            layer_type = self.config.layer_types[i]
            layer_attention_mask = attention_mask
            use_mm_bidirectional_mask = (
                kwargs.get("mm_token_type_ids") is not None
                and inputs_embeds.shape[1] != 1
                and getattr(self.config, "use_bidirectional_attention", None) == "vision"
            )
            if isinstance(attention_mask, dict):
                layer_attention_mask = attention_mask[layer_type]
            elif use_mm_bidirectional_mask:
                layer_attention_mask = None
            else:
                sliding_window = self.config.sliding_window if layer_type == "sliding_attention" else None
                target_length = (
                    min(self.config.sliding_window, self.config.max_position_embeddings)
                    if sliding_window
                    else inputs_embeds.shape[1]
                )
                layer_attention_mask = _build_additive_attention_mask(
                    position_ids=position_ids,
                    target_length=target_length,
                    dtype=hidden_states.dtype,
                    sliding_window=sliding_window,
                )

            hidden_states = decoder_layer(
                hidden_states,
                per_layer_input,
                position_embeddings=position_embeddings[layer_type],
                attention_mask=layer_attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=None)


class QEffGemma4DecoderWrapper(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.language_model = self.model.model.language_model
        self.config = self.model.config
        self.lm_head = self.model.lm_head

    def forward(self, input_ids, vision_embeds, position_ids, image_idx, past_key_values, mm_token_type_ids=None):
        # Prefer multimodal token type ids when available; this is the most reliable
        # marker for image placeholder span across tokenizer/template variants.
        if mm_token_type_ids is not None and mm_token_type_ids.shape == input_ids.shape:
            special_image_mask = mm_token_type_ids == 1
        else:
            special_image_mask = input_ids == self.config.image_token_id
        llm_input_ids = input_ids.clone()
        llm_input_ids[special_image_mask] = self.config.text_config.pad_token_id
        inputs_embeds = self.model.get_input_embeddings()(llm_input_ids)

        next_image_idx = image_idx
        if vision_embeds is not None and input_ids.shape[1] != 1 and special_image_mask.any():
            if vision_embeds.dim() == 2:
                vision_embeds = vision_embeds.unsqueeze(0)
            if next_image_idx is None:
                next_image_idx = torch.zeros((1, 1), dtype=torch.int64, device=inputs_embeds.device)

            indices1 = special_image_mask.to(torch.int64).cumsum(1) - 1
            indices1 = torch.where(indices1 != -1, indices1 + next_image_idx.to(indices1.device), indices1)
            indices0 = torch.arange(special_image_mask.shape[0], device=special_image_mask.device).view(-1, 1)
            safe_indices1 = torch.where(indices1 < 0, torch.zeros_like(indices1), indices1)
            gathered_vision_embeds = vision_embeds[indices0, safe_indices1]
            inputs_embeds = torch.where(special_image_mask.unsqueeze(-1), gathered_vision_embeds, inputs_embeds)
            next_image_idx = (indices1.max() + 1).reshape(1, 1)

        attention_mask = None
        per_layer_inputs = None
        outputs = self.language_model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=False,
            per_layer_inputs=per_layer_inputs,
            mm_token_type_ids=mm_token_type_ids,
        )
        logit_index = position_ids.to(torch.int32).argmax(1, keepdim=True)
        hidden_states = outputs[0][torch.arange(position_ids.shape[0]).view(-1, 1), logit_index]
        logits = self.lm_head(hidden_states)
        if self.config.text_config.final_logit_softcapping is not None:
            logits = logits / self.config.text_config.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * self.config.text_config.final_logit_softcapping
        logits = logits.float()
        return logits, vision_embeds, next_image_idx, outputs.past_key_values


_MODULE_MAPPING = {
    Gemma4TextAttention: QEffGemma4TextAttention,
    Gemma4TextDecoderLayer: QEffGemma4TextDecoderLayer,
    Gemma4TextModel: QEffGemma4TextModel,
}


def qeff_transform(model: nn.Module) -> nn.Module:
    for module in model.modules():
        repl = _MODULE_MAPPING.get(type(module))
        if repl is not None:
            module.__class__ = repl
    return model


def main():
    torch.manual_seed(0)
    mm_tokens_per_image = 6
    image_token_id = 60
    # E2B / E4B-style text config: `use_bidirectional_attention` is left unset (HF keeps image tokens causal).
    text_config = Gemma4TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=16,
        layer_types=["full_attention", "full_attention"],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=64,
        pad_token_id=0,
        max_position_embeddings=64,
    )
    vision_config = Gemma4VisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8
    )
    config = Gemma4Config(
        text_config=text_config.to_dict(),
        vision_config=vision_config.to_dict(),
        image_token_id=image_token_id,
        mm_tokens_per_image=mm_tokens_per_image,
    )
    model = Gemma4ForConditionalGeneration(config).eval()
    qeff_transform(model)
    wrapper = QEffGemma4DecoderWrapper(model).eval()

    # Two prompts of 14 tokens: text, one image (6 placeholders), then the question.
    bs, seq_len = 2, 14
    input_ids = torch.randint(3, 50, (bs, seq_len))
    input_ids[:, 0] = 2
    mm_token_type_ids = torch.zeros((bs, seq_len), dtype=torch.int64)
    for b, image_start in enumerate((3, 5)):
        input_ids[b, image_start : image_start + mm_tokens_per_image] = image_token_id
        mm_token_type_ids[b, image_start : image_start + mm_tokens_per_image] = 1
    vision_embeds = torch.randn(bs, mm_tokens_per_image, text_config.hidden_size)
    position_ids = torch.arange(seq_len, dtype=torch.int64).view(1, seq_len).repeat(bs, 1)
    image_idx = torch.zeros((1, 1), dtype=torch.int64)

    with torch.no_grad():
        logits, _, next_image_idx, _ = wrapper(
            input_ids=input_ids,
            vision_embeds=vision_embeds,
            position_ids=position_ids,
            image_idx=image_idx,
            past_key_values=None,
            mm_token_type_ids=mm_token_type_ids,
        )

    print("use_bidirectional_attention:", config.text_config.use_bidirectional_attention)
    print("next_image_idx:", next_image_idx.tolist())
    print("prefill logits[:, -1, :6]:", [[round(v, 5) for v in row] for row in logits[:, -1, :6].tolist()])
    print("first generated token:", logits[:, -1].argmax(-1).tolist())


if __name__ == "__main__":
    main()
