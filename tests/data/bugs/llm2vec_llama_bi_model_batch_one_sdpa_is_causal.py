"""LLM2Vec LlamaBiModel: a single unpadded input falls back to causal attention under SDPA.

Citation: McGill-NLP/llm2vec#74 ("For Llama models, bidirectional connections are not enabled when
batch size is 1"), fixed by PR #75, commit 2d85a4d ("remove condition which returns true for batch
size 1"). Read in the upstream git history (llm2vec/models/bidirectional_llama.py before/after).

Bug: ``LlamaBiModel._update_causal_mask`` copied transformers 4.40's shortcut
``if sdpa and AttentionMaskConverter._ignore_causal_mask_sdpa(...): return None``. With one
unpadded sequence (batch size 1, attention_mask all ones) the mask becomes ``None``, and the
transformers 4.40 ``LlamaSdpaAttention.forward`` then calls SDPA with
``is_causal=causal_mask is None and q_len > 1`` -- i.e. causal, although LLM2Vec set
``self.is_causal = False`` on its ModifiedLlamaSdpaAttention and built an all-zero (bidirectional)
mask everywhere else. Fix: the shortcut is commented out, so a zero (bidirectional) float mask is
always built and passed.

This program renders the two classes in plain torch (tiny random Llama; RoPE replaced by a
learned position table from the mask's cumsum) and runs ``encode`` on one sentence of 6 tokens, as LLM2Vec.encode does
for a batch of one; a second batch of two left-padded sentences shows the padded path.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class LlamaConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    pad_token_id: int = 0
    rms_norm_eps: float = 1e-6
    _attn_implementation: str = "sdpa"


class AttentionMaskConverter:
    @staticmethod
    def _ignore_causal_mask_sdpa(attention_mask, inputs_embeds, past_key_values_length):
        # transformers 4.40: rely on SDPA's is_causal when nothing is padded
        batch_size, query_length = inputs_embeds.shape[0], inputs_embeds.shape[1]
        key_value_length = query_length + past_key_values_length
        if attention_mask is None:
            return True
        if len(attention_mask.shape) == 2 and torch.all(attention_mask == 1):
            if query_length == 1 or key_value_length == query_length:
                return True
        return False


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)


class LlamaSdpaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.is_causal = True

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        causal_mask = attention_mask
        if attention_mask is not None:
            causal_mask = causal_mask[:, :, :, : key_states.shape[-2]]
        # transformers 4.40 LlamaSdpaAttention.forward: is_causal comes from the mask being None,
        # not from self.is_causal
        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states,
            attn_mask=causal_mask,
            dropout_p=0.0,
            is_causal=causal_mask is None and q_len > 1,
        )
        attn_output = attn_output.transpose(1, 2).contiguous().view(bsz, q_len, -1)
        return self.o_proj(attn_output)


class ModifiedLlamaSdpaAttention(LlamaSdpaAttention):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_causal = False


class ModifiedLlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = ModifiedLlamaSdpaAttention(config=config, layer_idx=layer_idx)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.SiLU(), nn.Linear(64, config.hidden_size))
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaBiModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.pos = nn.Embedding(32, config.hidden_size)
        self.layers = nn.ModuleList(
            [ModifiedLlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position, past_seen_tokens=0):
        if not FIXED and self.config._attn_implementation == "sdpa":
            # For SDPA, when possible, we will rely on its `is_causal` argument instead of its `attn_mask` argument,
            # in order to dispatch on Flash Attention 2.
            if AttentionMaskConverter._ignore_causal_mask_sdpa(
                attention_mask, inputs_embeds=input_tensor, past_key_values_length=past_seen_tokens
            ):
                return None

        dtype, device = input_tensor.dtype, input_tensor.device
        min_dtype = torch.finfo(dtype).min
        sequence_length = input_tensor.shape[1]
        target_length = attention_mask.shape[-1] if isinstance(attention_mask, torch.Tensor) else past_seen_tokens + sequence_length + 1

        causal_mask = torch.zeros((sequence_length, target_length), dtype=dtype, device=device)
        # Commenting out next 2 lines to disable causal masking
        # if sequence_length != 1:
        #     causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask *= torch.arange(target_length, device=device) > cache_position.reshape(-1, 1)
        causal_mask = causal_mask[None, None, :, :].expand(input_tensor.shape[0], 1, -1, -1)
        if attention_mask is not None:
            causal_mask = causal_mask.clone()
            mask_length = attention_mask.shape[-1]
            padding_mask = causal_mask[..., :mask_length].eq(0.0) * attention_mask[:, None, None, :].eq(0.0)
            causal_mask[..., :mask_length] = causal_mask[..., :mask_length].masked_fill(padding_mask, min_dtype)
        return causal_mask

    def forward(self, input_ids, attention_mask=None):
        inputs_embeds = self.embed_tokens(input_ids)
        cache_position = torch.arange(input_ids.shape[1])
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden_states = inputs_embeds + self.pos(position_ids)
        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position, 0)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=causal_mask)
        return self.norm(hidden_states)


def encode(model, input_ids, attention_mask):
    """LLM2Vec.encode with pooling_mode="mean" over the real tokens."""
    last_hidden_state = model(input_ids=input_ids, attention_mask=attention_mask)
    m = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    return (last_hidden_state * m).sum(1) / m.sum(1)


if __name__ == "__main__":
    config = LlamaConfig()
    model = LlamaBiModel(config).eval()
    with torch.no_grad():
        # batch size 1: tokenizer returns an all-ones attention_mask
        ids = torch.tensor([[5, 17, 23, 9, 41, 12]])
        emb1 = encode(model, ids, torch.ones_like(ids))
        # batch of two, left padded (LLM2Vec tokenizers pad left)
        ids2 = torch.tensor([[5, 17, 23, 9, 41, 12], [0, 0, 7, 30, 2, 19]])
        am2 = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
        emb2 = encode(model, ids2, am2)
    print("fixed" if FIXED else "buggy", "bs1 vs bs2 row0 max diff:", f"{(emb1[0] - emb2[0]).abs().max().item():.4f}")
