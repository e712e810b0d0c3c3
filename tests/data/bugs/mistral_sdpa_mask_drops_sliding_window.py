"""Mistral SDPA path (transformers <= 4.39) built its 4D mask without the sliding window.

Citation: huggingface/transformers#28980 ("Add sliding window attention to sdpa in mistral": "the
latest version of transformers cannot use sliding window feature in mistral model") fixed by
huggingface/transformers#30127 ("Fix SDPA sliding window compatibility", merged 2024-04). The PR:
"This bug dates back to #26572 where `sliding_window` was not properly accounted for in the
`_prepare_4d_causal_attention_mask_for_sdpa` method. Since then, SDPA support was added to models that
use sliding window, but this bug was not yet fixed."

Bug: `MistralModel.forward` passes `sliding_window=self.config.sliding_window` to the eager mask
builder but calls `_prepare_4d_causal_attention_mask_for_sdpa(attention_mask, (batch_size,
seq_length), inputs_embeds, past_key_values_length)` for `attn_implementation="sdpa"`, whose
`AttentionMaskConverter(is_causal=True)` has no window: SDPA layers attend the full causal prefix.
Fix: `_prepare_4d_causal_attention_mask_for_sdpa(..., sliding_window=self.config.sliding_window)`; the
converter bands the mask, and the "drop the mask, use is_causal" shortcut is only taken when
`key_value_length < sliding_window`.

The mask helpers are written from my memory of transformers 4.39/4.40 (`modeling_attn_mask_utils.py`,
simplified: no tracing branch); the PR/issue text above is what I could read.

This program: a one-layer SDPA Mistral-style model, `config.sliding_window = 4`, a left-padded batch
(prompts of 9 and 6 real tokens) prefilled then decoded for two greedy steps with a tuple KV cache.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


@dataclass
class MistralConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    sliding_window: int = 4
    pad_token_id: int = 0
    _attn_implementation: str = "sdpa"


class AttentionMaskConverter:
    def __init__(self, is_causal, sliding_window=None):
        self.is_causal = is_causal
        self.sliding_window = sliding_window

    def to_causal_4d(self, batch_size, query_length, key_value_length, dtype, device):
        past_key_values_length = key_value_length - query_length
        return self._make_causal_mask((batch_size, query_length), dtype, device,
                                      past_key_values_length, self.sliding_window)

    def to_4d(self, attention_mask_2d, query_length, dtype, key_value_length):
        input_shape = (attention_mask_2d.shape[0], query_length)
        causal_4d_mask = None
        if (input_shape[-1] > 1 or self.sliding_window is not None) and self.is_causal:
            past_key_values_length = key_value_length - query_length
            causal_4d_mask = self._make_causal_mask(input_shape, dtype, attention_mask_2d.device,
                                                    past_key_values_length, self.sliding_window)
        expanded_attn_mask = self._expand_mask(attention_mask_2d, dtype, tgt_len=input_shape[-1])
        if causal_4d_mask is not None:
            expanded_attn_mask = causal_4d_mask.masked_fill(expanded_attn_mask.bool(), torch.finfo(dtype).min)
        return expanded_attn_mask

    @staticmethod
    def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0, sliding_window=None):
        bsz, tgt_len = input_ids_shape
        mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
        mask_cond = torch.arange(mask.size(-1), device=device)
        mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
        mask = mask.to(dtype)
        if past_key_values_length > 0:
            mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
        # add lower triangular sliding window mask if necessary
        if sliding_window is not None:
            diagonal = past_key_values_length - sliding_window + 1
            context_mask = 1 - torch.triu(torch.ones_like(mask, dtype=torch.int), diagonal=diagonal)
            mask.masked_fill_(context_mask.bool(), torch.finfo(dtype).min)
        return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)

    @staticmethod
    def _expand_mask(mask, dtype, tgt_len=None):
        bsz, src_len = mask.size()
        tgt_len = tgt_len if tgt_len is not None else src_len
        expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
        inverted_mask = 1.0 - expanded_mask
        return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


def _prepare_4d_causal_attention_mask_for_sdpa(attention_mask, input_shape, inputs_embeds,
                                               past_key_values_length, sliding_window=None):
    """Prepares the correct `attn_mask` argument to be used by `torch.nn.functional.scaled_dot_product_attention`."""
    attn_mask_converter = AttentionMaskConverter(is_causal=True, sliding_window=sliding_window)
    key_value_length = input_shape[-1] + past_key_values_length
    batch_size, query_length = input_shape
    if attention_mask is not None and torch.all(attention_mask == 1):
        ignorable = sliding_window is None or key_value_length < sliding_window
        if query_length == 1 and ignorable:
            # For query_length == 1, causal attention and bi-directional attention are the same.
            attention_mask = None
        elif key_value_length == query_length and ignorable:
            attention_mask = None
    if attention_mask is None:
        return None
    return attn_mask_converter.to_4d(attention_mask, input_shape[-1], dtype=inputs_embeds.dtype,
                                     key_value_length=key_value_length)


class MistralSdpaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states)
        key_states = key_states.repeat_interleave(self.num_key_value_groups, dim=1)
        value_states = value_states.repeat_interleave(self.num_key_value_groups, dim=1)
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=attention_mask,
            # The q_len > 1 is necessary to match with AttentionMaskConverter.to_causal_4d that does not
            # create a causal mask in case q_len == 1.
            is_causal=self.is_causal and attention_mask is None and q_len > 1)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), past_key_value


class MistralForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.self_attn = MistralSdpaAttention(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, past_key_values=None):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = 0 if past_key_values is None else past_key_values[0].shape[2]
        inputs_embeds = self.embed_tokens(input_ids)
        if self.config._attn_implementation == "sdpa":
            # output_attentions=True can not be supported when using SDPA, and we fall back on
            # the manual implementation that requires a 4D causal mask in all cases.
            if FIXED:
                attention_mask = _prepare_4d_causal_attention_mask_for_sdpa(
                    attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length,
                    sliding_window=self.config.sliding_window)
            else:
                attention_mask = _prepare_4d_causal_attention_mask_for_sdpa(
                    attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length)
        h, past = self.self_attn(inputs_embeds, attention_mask=attention_mask, past_key_value=past_key_values)
        return self.lm_head(inputs_embeds + h), past


def main():
    config = MistralConfig()
    model = MistralForCausalLM(config).eval()
    input_ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8, 9],
                              [0, 0, 0, 27, 18, 28, 18, 28, 45]])
    attention_mask = (input_ids != config.pad_token_id).long()
    out = []
    with torch.no_grad():
        logits, past = model(input_ids, attention_mask)
        for _ in range(2):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)], dim=-1)
            logits, past = model(nxt, attention_mask, past_key_values=past)
    print("generated:", torch.cat(out, -1).tolist())


if __name__ == "__main__":
    main()
