"""transformers Llama (SDPA): output_attentions=True falls back to eager attention with no causal mask.

Citation: huggingface/transformers PR #30652 "Fix llama model sdpa attention forward function masking
bug when output_attentions=True" (merged, May 2024; same change propagated to the models copied from
Llama, e.g. JetMoe).

Bug (from the PR description): with `attn_implementation="sdpa"`, `LlamaModel._update_causal_mask`
returns `None` whenever `AttentionMaskConverter._ignore_causal_mask_sdpa` says the input is unmasked
(one sequence, or a batch of equal lengths), leaving causality to SDPA's `is_causal`. But when
`output_attentions=True`, `LlamaSdpaAttention.forward` falls back to the eager
`LlamaAttention.forward`, which only adds `attention_mask` if it is not None, and has no `is_causal`.
So the eager softmax ran with no causal mask: every token attended to the tokens after it.

Fix: `_update_causal_mask` takes `output_attentions` and only skips the mask for SDPA when
`not output_attentions`, so the eager fallback receives the 4-D causal mask.

This program: a one-layer Llama-style model built from a config with
`_attn_implementation="sdpa"`, an unpadded batch of two sequences (all-ones `attention_mask`), and
`output_attentions=True`. Module/function bodies are written after transformers 4.40's
modeling_llama.py as known (RoPE, MLP and norms omitted); `_ignore_causal_mask_sdpa` is reduced to
its unpadded-prefill case.
"""
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class LlamaConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 1
    vocab_size: int = 50
    _attn_implementation: str = "sdpa"


class AttentionMaskConverter:
    @staticmethod
    def _ignore_causal_mask_sdpa(attention_mask, inputs_embeds, past_key_values_length):
        """True when SDPA's is_causal alone gives the right mask (no padding, no past)."""
        _, query_length = inputs_embeds.shape[:2]
        key_value_length = query_length + past_key_values_length
        if attention_mask is None:
            return query_length == 1 or key_value_length == query_length
        if len(attention_mask.shape) == 2 and torch.all(attention_mask == 1):
            return query_length == 1 or key_value_length == query_length
        return False


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.is_causal = True
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

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:  # no matter the length, we just slice it
            causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
            attn_weights = attn_weights + causal_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), (attn_weights if output_attentions else None)


class LlamaSdpaAttention(LlamaAttention):
    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        if output_attentions:
            # "LlamaModel is using LlamaSdpaAttention, but SDPA does not support output_attentions=True.
            #  Falling back to the manual attention implementation"
            return super().forward(hidden_states, attention_mask=attention_mask, output_attentions=output_attentions)
        bsz, q_len, _ = hidden_states.size()
        query_states = self._shape(self.q_proj(hidden_states), bsz, q_len)
        key_states = self._shape(self.k_proj(hidden_states), bsz, q_len)
        value_states = self._shape(self.v_proj(hidden_states), bsz, q_len)
        causal_mask = attention_mask
        if attention_mask is not None:
            causal_mask = causal_mask[:, :, :, : key_states.shape[-2]]
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=causal_mask,
            is_causal=causal_mask is None and q_len > 1,
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), None


LLAMA_ATTENTION_CLASSES = {"eager": LlamaAttention, "sdpa": LlamaSdpaAttention}


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LLAMA_ATTENTION_CLASSES[config._attn_implementation](config, i) for i in range(config.num_hidden_layers)]
        )

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position, past_seen_tokens, output_attentions):
        if FIXED:
            skip = self.config._attn_implementation == "sdpa" and not output_attentions
        else:
            skip = self.config._attn_implementation == "sdpa"
        if skip:
            # For SDPA, when possible, we will rely on its `is_causal` argument instead of its `attn_mask`
            # argument, in order to dispatch on Flash Attention 2.
            if AttentionMaskConverter._ignore_causal_mask_sdpa(
                attention_mask, inputs_embeds=input_tensor, past_key_values_length=past_seen_tokens
            ):
                return None

        dtype = input_tensor.dtype
        min_dtype = torch.finfo(dtype).min
        sequence_length = input_tensor.shape[1]
        target_length = past_seen_tokens + sequence_length
        causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
        if sequence_length != 1:
            causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask *= torch.arange(target_length) > cache_position.reshape(-1, 1)
        causal_mask = causal_mask[None, None, :, :].expand(input_tensor.shape[0], 1, -1, -1)
        if attention_mask is not None:
            causal_mask = causal_mask.clone()
            mask_length = attention_mask.shape[-1]
            padding_mask = causal_mask[..., :mask_length].eq(0.0) * attention_mask[:, None, None, :].eq(0.0)
            causal_mask[..., :mask_length] = causal_mask[..., :mask_length].masked_fill(padding_mask, min_dtype)
        return causal_mask

    def forward(self, input_ids, attention_mask=None, output_attentions=False):
        inputs_embeds = self.embed_tokens(input_ids)
        past_seen_tokens = 0
        cache_position = torch.arange(past_seen_tokens, past_seen_tokens + inputs_embeds.shape[1])
        causal_mask = self._update_causal_mask(
            attention_mask, inputs_embeds, cache_position, past_seen_tokens, output_attentions
        )
        hidden_states = inputs_embeds
        all_self_attns = ()
        for decoder_layer in self.layers:
            out, attn = decoder_layer(hidden_states, attention_mask=causal_mask, output_attentions=output_attentions)
            hidden_states = hidden_states + out
            all_self_attns += (attn,)
        return hidden_states, all_self_attns


def main():
    torch.manual_seed(0)
    config = LlamaConfig()
    model = LlamaModel(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 7))
    attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        hidden, attns = model(input_ids, attention_mask=attention_mask, output_attentions=True)
    future = attns[0].triu(diagonal=1).sum().item()
    print("fixed" if FIXED else "buggy", "attention weight on future tokens", round(future, 4))


if __name__ == "__main__":
    main()
