"""transformers Llama (v4.40 era), SDPA attention: output_attentions=True falls back to eager with no causal mask.

Citation: huggingface/transformers#30652 "Fix llama model sdpa attention forward function masking
bug when output_attentions=True" (merged 2024-05).

With ``attn_implementation="sdpa"``, ``LlamaModel._update_causal_mask`` returns ``None`` whenever
``AttentionMaskConverter._ignore_causal_mask_sdpa`` says the input is unmasked (no padding in the
attention mask, or no attention mask): SDPA will then be called with ``is_causal=True`` instead of a
materialized mask. But ``LlamaSdpaAttention.forward`` does not call SDPA when ``output_attentions``
is requested: it falls back to the eager ``LlamaAttention.forward``, which adds the causal mask it
is given (``None``) to ``q @ k^T`` and so runs fully unmasked attention - every token sees later
tokens. The fix builds the 4D causal mask when ``output_attentions`` is set
(``if self.config._attn_implementation == "sdpa" and not using_static_cache and not output_attentions``).

This program renders the Llama model code of that era in plain torch (config dataclass, the
``_update_causal_mask`` / ``_ignore_causal_mask_sdpa`` pair, eager and SDPA attention classes) and
runs an unpadded batch with ``output_attentions=True``.
"""
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class LlamaConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    intermediate_size: int = 64
    _attn_implementation: str = "sdpa"


class AttentionMaskConverter:
    @staticmethod
    def _ignore_causal_mask_sdpa(attention_mask, inputs_embeds, past_key_values_length):
        """Detect when the causal mask can be dropped and SDPA's is_causal used instead."""
        _, query_length = inputs_embeds.shape[0], inputs_embeds.shape[1]
        key_value_length = query_length + past_key_values_length
        if attention_mask is None:
            return True
        if attention_mask.dim() == 2 and (query_length == 1 or key_value_length == query_length):
            return bool(torch.all(attention_mask == 1))
        return False


class LlamaAttention(nn.Module):
    """Eager attention."""

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def _shape(self, x, bsz, q_len):
        return x.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        bsz, q_len, _ = hidden_states.size()
        query_states = self._shape(self.q_proj(hidden_states), bsz, q_len)
        key_states = self._shape(self.k_proj(hidden_states), bsz, q_len)
        value_states = self._shape(self.v_proj(hidden_states), bsz, q_len)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / self.head_dim ** 0.5
        if attention_mask is not None:  # no matter the length, we just slice it
            causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
            attn_weights = attn_weights + causal_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = self.o_proj(attn_output.transpose(1, 2).reshape(bsz, q_len, -1))
        return attn_output, (attn_weights if output_attentions else None)


class LlamaSdpaAttention(LlamaAttention):
    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        if output_attentions:
            # "LlamaModel is using LlamaSdpaAttention, but torch.nn.functional.scaled_dot_product_attention
            # does not support output_attentions=True. Falling back to the manual attention implementation"
            return super().forward(hidden_states, attention_mask=attention_mask, output_attentions=output_attentions)
        bsz, q_len, _ = hidden_states.size()
        query_states = self._shape(self.q_proj(hidden_states), bsz, q_len)
        key_states = self._shape(self.k_proj(hidden_states), bsz, q_len)
        value_states = self._shape(self.v_proj(hidden_states), bsz, q_len)
        causal_mask = attention_mask
        if attention_mask is not None:
            causal_mask = causal_mask[:, :, :, : key_states.shape[-2]]
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=causal_mask, is_causal=causal_mask is None and q_len > 1
        )
        attn_output = self.o_proj(attn_output.transpose(1, 2).reshape(bsz, q_len, -1))
        return attn_output, None


LLAMA_ATTENTION_CLASSES = {"eager": LlamaAttention, "sdpa": LlamaSdpaAttention}


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = LLAMA_ATTENTION_CLASSES[config._attn_implementation](config, layer_idx)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.SiLU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))
        self.input_layernorm = nn.RMSNorm(config.hidden_size)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        residual = hidden_states
        hidden_states, attn_weights = self.self_attn(self.input_layernorm(hidden_states), attention_mask, output_attentions)
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, attn_weights


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size)

    def forward(self, input_ids, attention_mask=None, output_attentions=False):
        inputs_embeds = self.embed_tokens(input_ids)
        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, output_attentions)
        hidden_states = inputs_embeds
        all_self_attns = ()
        for decoder_layer in self.layers:
            hidden_states, attn = decoder_layer(hidden_states, causal_mask, output_attentions)
            if output_attentions:
                all_self_attns += (attn,)
        return self.norm(hidden_states), all_self_attns

    def _update_causal_mask(self, attention_mask, input_tensor, output_attentions):
        past_seen_tokens = 0
        skip_if_sdpa = self.config._attn_implementation == "sdpa"
        if FIXED:
            skip_if_sdpa = skip_if_sdpa and not output_attentions
        if skip_if_sdpa:
            # SDPA's is_causal argument is used instead of the 4D mask whenever possible.
            if AttentionMaskConverter._ignore_causal_mask_sdpa(attention_mask, input_tensor, past_seen_tokens):
                return None

        dtype = input_tensor.dtype
        min_dtype = torch.finfo(dtype).min
        sequence_length = input_tensor.shape[1]
        target_length = attention_mask.shape[-1] if attention_mask is not None else sequence_length
        causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
        causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask = causal_mask[None, None, :, :].expand(input_tensor.shape[0], 1, -1, -1).clone()
        if attention_mask is not None:
            padding_mask = causal_mask[..., :target_length].eq(0.0) * attention_mask[:, None, None, :].eq(0.0)
            causal_mask[..., :target_length] = causal_mask[..., :target_length].masked_fill(padding_mask, min_dtype)
        return causal_mask


def main():
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig()).eval()
    input_ids = torch.randint(0, 64, (2, 6))
    attention_mask = torch.ones(2, 6, dtype=torch.long)
    with torch.no_grad():
        _, attentions = model(input_ids, attention_mask=attention_mask, output_attentions=True)
    # Weight the first token puts on the tokens after it (0 for a causal model).
    print("attention mass on future tokens (layer 0, token 0):", round(float(attentions[0][0, :, 0, 1:].sum(-1).mean()), 4))


if __name__ == "__main__":
    main()
