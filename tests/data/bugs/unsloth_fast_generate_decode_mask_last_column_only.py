"""Unsloth fast generation keeps only the last attention-mask column after prefill (left pads attended).

Citation: unslothai/unsloth#2216 ("Fix batched generation for prompts of different lengths", merged as
45f26cda996ec0b9a2e28cb18a03251095aa29e8; branch commit 47c066b "fix ignoring of attention mask after
prefill stage in decoding"); reported in unslothai/unsloth#1066, where the PR author explains: "After
prefilling stage in decoding attention mask becomes simply [1] and we forget that pad tokens at the start
shouldn't be attended to."

Bug: ``_fast_prepare_inputs_for_generation`` (unsloth/models/llama.py), which Unsloth installs as the
model's ``prepare_inputs_for_generation``, did ``kwargs["attention_mask"] = kwargs["attention_mask"][:,[-1]]``
once a cache existed.  ``LlamaModel_fast_forward_inference`` then built its decode mask with
``_prepare_4d_causal_attention_mask_for_sdpa(attention_mask, (bsz, 1), X, seq_len)``; a (bsz, 1) column of
ones is "all ones with a single query", so the helper returns ``None`` and the decode SDPA call attends to
every cached key, the left padding of the shorter prompts included.
Fix: keep the full 2-D mask and turn it into a 4-D mask with the base model's
``_prepare_4d_causal_attention_mask_with_cache_position`` (pads masked), passed through to the decode SDPA.

This program: a two-layer Llama (``transformers.LlamaConfig`` holds the config) with Unsloth's prefill /
decode split written in plain torch: prefill with the 4-D SDPA mask, decode through a per-layer KV cache
and ``F.scaled_dot_product_attention(attn_mask=...)``, driven by a greedy loop that extends the 2-D
``attention_mask`` with ones every step as ``generate`` does.  The two mask helpers are short ports of the
transformers 4.4x functions (``modeling_attn_mask_utils`` is gone in transformers 5).  RoPE is left out.
Batch of two prompts, the first left-padded by 3.  ``--fixed`` applies #2216.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

FIXED = "--fixed" in sys.argv


def _prepare_4d_causal_attention_mask_for_sdpa(attention_mask, input_shape, inputs_embeds, past_key_values_length):
    """transformers 4.4x helper: a 4-D mask passes through; an all-ones 2-D mask with one query gives None."""
    batch_size, query_length = input_shape
    key_value_length = query_length + past_key_values_length
    dtype = inputs_embeds.dtype
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    if attention_mask is None or (torch.all(attention_mask == 1) and
                                  (query_length == 1 or key_value_length == query_length)):
        return None
    min_dtype = torch.finfo(dtype).min
    q_pos = torch.arange(past_key_values_length, key_value_length)[:, None]
    k_pos = torch.arange(key_value_length)[None, :]
    causal = torch.zeros(query_length, key_value_length, dtype=dtype).masked_fill(k_pos > q_pos, min_dtype)
    expanded = causal[None, None].expand(batch_size, 1, -1, -1).clone()
    return expanded.masked_fill(attention_mask[:, None, None, :] == 0, min_dtype)


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @staticmethod
    def _prepare_4d_causal_attention_mask_with_cache_position(attention_mask, sequence_length, target_length,
                                                             dtype, device, cache_position, batch_size, **kwargs):
        min_dtype = torch.finfo(dtype).min
        causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype, device=device)
        if sequence_length != 1:
            causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask *= torch.arange(target_length, device=device) > cache_position.reshape(-1, 1)
        causal_mask = causal_mask[None, None, :, :].expand(batch_size, 1, -1, -1)
        if attention_mask is not None:
            causal_mask = causal_mask.clone()
            mask_length = attention_mask.shape[-1]
            padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :]
            padding_mask = padding_mask == 0
            causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(padding_mask, min_dtype)
        return causal_mask


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.n_heads
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, X, past_key_value, attention_mask):
        bsz, q_len, _ = X.shape
        Q = self.q_proj(X).view(bsz, q_len, self.n_heads, self.head_dim).transpose(1, 2)
        K = self.k_proj(X).view(bsz, q_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        V = self.v_proj(X).view(bsz, q_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if past_key_value is not None:
            K = torch.cat([past_key_value[0], K], dim=2)
            V = torch.cat([past_key_value[1], V], dim=2)
        # is_casual and attention_mask must not be both set!
        A = F.scaled_dot_product_attention(Q, K, V, attn_mask=attention_mask,
                                           is_causal=attention_mask is None and q_len > 1, enable_gqa=True)
        return self.o_proj(A.transpose(1, 2).reshape(bsz, q_len, -1)), (K, V)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, X, past_key_value, attention_mask):
        a, kv = self.self_attn(self.input_layernorm(X), past_key_value, attention_mask)
        X = X + a
        h = self.post_attention_layernorm(X)
        return X + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)), kv


class LlamaForCausalLM(nn.Module):
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.dtype = torch.float32
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """Unsloth's _fast_prepare_inputs_for_generation."""
        past_key_values = kwargs.get("past_key_values", None)
        if past_key_values is not None:
            if FIXED:
                bs, cache_length = input_ids.shape
                input_ids = input_ids[:, [-1]]
                base_model = self
                if hasattr(base_model, "base_model_prefix"):
                    base_model = getattr(base_model, base_model.base_model_prefix)
                attention_mask = base_model._prepare_4d_causal_attention_mask_with_cache_position(
                    attention_mask, sequence_length=1, target_length=cache_length, dtype=self.dtype,
                    device=input_ids.device,
                    cache_position=torch.arange(cache_length, cache_length + 1, device=input_ids.device),
                    batch_size=bs, config=self.config, past_key_values=past_key_values)
            else:
                input_ids = input_ids[:, [-1]]
                attention_mask = attention_mask[:, [-1]]
        return {"input_ids": input_ids, "attention_mask": attention_mask, **kwargs}

    def forward(self, input_ids, attention_mask=None, past_key_values=None):
        X = self.model.embed_tokens(input_ids)
        bsz, q_len, _ = X.shape
        if past_key_values is None:  # LlamaModel_fast_forward (prefill)
            attention_mask = _prepare_4d_causal_attention_mask_for_sdpa(attention_mask, (bsz, q_len), X, 0)
            past_key_values = [None] * len(self.model.layers)
        else:  # LlamaModel_fast_forward_inference (one token)
            seq_len = past_key_values[0][0].shape[-2]
            if bsz != 1:
                attention_mask = _prepare_4d_causal_attention_mask_for_sdpa(attention_mask, (bsz, q_len), X, seq_len)
            else:
                attention_mask = None
        next_decoder_cache = []
        for idx, layer in enumerate(self.model.layers):
            X, kv = layer(X, past_key_values[idx], attention_mask)
            next_decoder_cache.append(kv)
        return self.lm_head(self.model.norm(X)), next_decoder_cache


def main():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    # tokenizer.padding_side = "left"
    input_ids = torch.tensor([[0, 0, 0, 9, 14, 33], [7, 25, 3, 51, 18, 40]])
    attention_mask = (input_ids != config.pad_token_id).long()
    past_key_values = None
    with torch.no_grad():
        for _ in range(4):
            inputs = model.prepare_inputs_for_generation(input_ids, attention_mask=attention_mask,
                                                         past_key_values=past_key_values)
            logits, past_key_values = model(**inputs)
            next_tokens = logits[:, -1].argmax(-1, keepdim=True)
            input_ids = torch.cat([input_ids, next_tokens], dim=-1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], -1)
    print("fixed" if FIXED else "buggy", "row 0 logits[:3]:", [round(v, 4) for v in logits[0, -1, :3].tolist()],
          "generated:", input_ids[:, 6:].tolist())


if __name__ == "__main__":
    main()
