"""Mistral (transformers 4.34) eager sliding-window mask: one key too many, and no window on decode.

Citation: huggingface/transformers#26792 ("Remove ambiguous `padding_mask` and instead use a 2D->4D
Attn Mask Mapper", merged 2023-10). In review, patrickvonplaten: "this corrects a bug that was in
Mistral's windowed attention" -- `torch.triu(mask, diagonal=-sliding_window)` keeps
`sliding_window + 1` keys per query ("which is incorrect").

Bug (pre-fix `modeling_mistral.py`): `_make_sliding_window_causal_mask` bands the causal mask with
`torch.triu(mask, diagonal=-sliding_window)` (window + 1 keys), concatenates an all-zero block for
`past_key_values_length` (every cached key visible whatever the window), and
`_prepare_decoder_attention_mask` only builds it when `input_shape[-1] > 1`, so single-token decode
steps get the padding mask alone: no window at all.
Fix (#26792): `AttentionMaskConverter(is_causal=True, sliding_window=...)`; `_make_causal_mask` masks
`1 - torch.triu(ones, diagonal=past_key_values_length - sliding_window + 1)` over the full
(past + new) width, and `to_4d` builds the causal mask also for one-token steps when a sliding
window is set.

The pre-fix `_make_sliding_window_causal_mask` matches copies of it found in public code; the
fix's `_make_causal_mask` window lines are from the PR's review excerpt, and `to_4d` is written from my
memory of `modeling_attn_mask_utils.py` (I did not re-read the merged diff).

This program: a one-layer eager Mistral-style model with a tuple KV cache, a left-padded batch of two
prompts (7 and 5 real tokens), `config.sliding_window = 3`, prefill then three greedy decode steps.
"""
import math
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


@dataclass
class MistralConfig:
    vocab_size: int = 50
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    sliding_window: int = 3
    pad_token_id: int = 0


def _make_sliding_window_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0,
                                     sliding_window=4096):
    """
    Make causal mask used for sliding window attention
    """
    bsz, tgt_len = input_ids_shape

    tensor = torch.full((tgt_len, tgt_len), fill_value=1, device=device)
    mask = torch.tril(tensor, diagonal=0)
    # make the mask banded to account for sliding window
    mask = torch.triu(mask, diagonal=-sliding_window)
    mask = torch.log(mask).to(dtype)

    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask, dtype, tgt_len=None):
    """
    Expands attention_mask from `[bsz, seq_len]` to `[bsz, 1, tgt_seq_len, src_seq_len]`.
    """
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


class AttentionMaskConverter:
    """The 2D->4D mapper introduced by the fix."""

    def __init__(self, is_causal, sliding_window=None):
        self.is_causal = is_causal
        self.sliding_window = sliding_window

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

    def to_4d(self, attention_mask_2d, query_length, key_value_length, dtype):
        input_shape = (attention_mask_2d.shape[0], query_length)
        causal_4d_mask = None
        if (input_shape[-1] > 1 or self.sliding_window is not None) and self.is_causal:
            past_key_values_length = key_value_length - query_length
            causal_4d_mask = self._make_causal_mask(input_shape, dtype, attention_mask_2d.device,
                                                    past_key_values_length, self.sliding_window)
        expanded_attn_mask = _expand_mask(attention_mask_2d, dtype, tgt_len=input_shape[-1])
        if causal_4d_mask is not None:
            expanded_attn_mask = causal_4d_mask.masked_fill(expanded_attn_mask.bool(), torch.finfo(dtype).min)
        return expanded_attn_mask


class MistralAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
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

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(attn_output), past_key_value


class MistralForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.self_attn = MistralAttention(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds,
                                        past_key_values_length, sliding_window):
        # create causal mask
        # [bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len]
        combined_attention_mask = None
        if input_shape[-1] > 1:
            combined_attention_mask = _make_sliding_window_causal_mask(
                input_shape, inputs_embeds.dtype, device=inputs_embeds.device,
                past_key_values_length=past_key_values_length, sliding_window=sliding_window)
        if attention_mask is not None:
            expanded_attn_mask = _expand_mask(attention_mask, inputs_embeds.dtype, tgt_len=input_shape[-1])
            combined_attention_mask = (
                expanded_attn_mask if combined_attention_mask is None
                else expanded_attn_mask + combined_attention_mask)
        return combined_attention_mask

    def forward(self, input_ids, attention_mask, past_key_values=None):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = 0 if past_key_values is None else past_key_values[0].shape[2]
        inputs_embeds = self.embed_tokens(input_ids)
        if FIXED:
            converter = AttentionMaskConverter(is_causal=True, sliding_window=self.config.sliding_window)
            attention_mask = converter.to_4d(attention_mask, seq_length, seq_length + past_key_values_length,
                                             inputs_embeds.dtype)
        else:
            attention_mask = self._prepare_decoder_attention_mask(
                attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length,
                sliding_window=self.config.sliding_window)
        h, past = self.self_attn(inputs_embeds, attention_mask=attention_mask, past_key_value=past_key_values)
        return self.lm_head(inputs_embeds + h), past


def main():
    config = MistralConfig()
    model = MistralForCausalLM(config).eval()
    # tokenizer(padding_side="left")
    input_ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17],
                              [0, 0, 21, 22, 23, 24, 25]])
    attention_mask = (input_ids != config.pad_token_id).long()
    generated = []
    with torch.no_grad():
        logits, past = model(input_ids, attention_mask)
        for _ in range(3):
            next_tokens = logits[:, -1].argmax(-1, keepdim=True)
            generated.append(next_tokens)
            attention_mask = torch.cat([attention_mask, torch.ones_like(next_tokens)], dim=-1)
            logits, past = model(next_tokens, attention_mask, past_key_values=past)
    print("generated:", torch.cat(generated, dim=-1).tolist())


if __name__ == "__main__":
    main()
