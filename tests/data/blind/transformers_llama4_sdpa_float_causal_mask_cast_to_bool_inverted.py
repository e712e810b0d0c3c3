"""transformers Llama 4 (SDPA): the float causal mask is cast with .bool(), which inverts it.

Citation: huggingface/transformers PR #38094 "In Llama4 fix wrongly inverted causal attention mask
when using SDPA implementation" (merged, May 2025).

Bug (from the PR description): in `Llama4TextModel._update_causal_mask`, on the SDPA path with a
chunked attention mask, the (global-layer) `causal_mask` arrives as a float tensor holding 0.0 where
attention is allowed and `torch.finfo(dtype).min` where it is masked, and was converted with
`causal_mask = causal_mask.bool()`. SDPA reads a boolean mask as True = may attend, so the cast
inverted it: every allowed cell became masked and every masked one (future tokens, padding) allowed.
The mask is only materialised (not dropped for `is_causal`) when the batch is padded, e.g. left-padded
generation prompts.

Fix: compare against the masked value instead of casting
(`causal_mask = causal_mask != torch.finfo(dtype).min` here; the exact line of the merged diff was not
read, only the description and title).

This program: a two-layer Llama-4-style text model built from a config with
`_attn_implementation="sdpa"` and `attention_chunk_size=4`: layer 0 is a chunked (RoPE) layer fed
`chunked_attention_mask`, layer 1 a global (NoPE) layer fed `causal_mask`; a left-padded batch of two
prompts. Bodies written after transformers 4.51's modeling_llama4.py as known (MLP/norms/RoPE omitted).
"""
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Llama4TextConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    vocab_size: int = 64
    attention_chunk_size: int = 4
    no_rope_layers: list = field(default_factory=lambda: [1, 0])  # 1 = uses RoPE (chunked), 0 = NoPE (global)
    _attn_implementation: str = "sdpa"


class Llama4TextAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.use_rope = bool(config.no_rope_layers[layer_idx])
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        b, n, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None and n > 1)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class Llama4TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Llama4TextAttention(config, i) for i in range(config.num_hidden_layers)])

    def create_chunked_attention_mask(self, attention_chunk_size, start, end, device):
        arange_vector = torch.arange(start, end, device=device)
        block_pos = torch.abs(
            (arange_vector.unsqueeze(0) // attention_chunk_size) - (arange_vector.unsqueeze(1) // attention_chunk_size)
        )
        token_pos = arange_vector.unsqueeze(0) - arange_vector.unsqueeze(1)
        mask = (block_pos == 0) & (token_pos <= 0)
        return mask.to(device)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position):
        dtype, device = input_tensor.dtype, input_tensor.device
        min_dtype = torch.finfo(dtype).min
        sequence_length = input_tensor.shape[1]
        target_length = attention_mask.shape[-1]

        causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype, device=device)
        if sequence_length != 1:
            causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask *= torch.arange(target_length, device=device) > cache_position.reshape(-1, 1)
        causal_mask = causal_mask[None, None, :, :].expand(input_tensor.shape[0], 1, -1, -1).clone()
        mask_length = attention_mask.shape[-1]
        padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :].to(dtype)
        padding_mask = padding_mask == 0
        causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(padding_mask, min_dtype)

        chunked_attention_mask = self.create_chunked_attention_mask(
            self.config.attention_chunk_size, start=0, end=target_length, device=device
        )[None, None, :, :]
        local_attention_mask = attention_mask[:, :target_length]
        requires_padding = (local_attention_mask == 0).any()
        if requires_padding:
            chunked_attention_mask = chunked_attention_mask * local_attention_mask[:, None, None, :]

        if self.config._attn_implementation == "sdpa" and chunked_attention_mask is not None:
            chunked_attention_mask = chunked_attention_mask.bool()
            if FIXED:
                causal_mask = causal_mask != min_dtype
            else:
                causal_mask = causal_mask.bool()
            if (attention_mask == 1).all():  # _ignore_causal_mask_sdpa: unpadded prefill relies on is_causal
                causal_mask = None
        return causal_mask, chunked_attention_mask

    def forward(self, input_ids, attention_mask):
        hidden_states = self.embed_tokens(input_ids)
        cache_position = torch.arange(hidden_states.shape[1])
        causal_mask, chunk_causal_mask = self._update_causal_mask(attention_mask, hidden_states, cache_position)
        for layer in self.layers:
            mask = chunk_causal_mask if layer.use_rope else causal_mask
            hidden_states = hidden_states + layer(hidden_states, attention_mask=mask)
        return hidden_states


def main():
    torch.manual_seed(0)
    config = Llama4TextConfig()
    model = Llama4TextModel(config).eval()
    input_ids = torch.randint(1, config.vocab_size, (2, 8))
    attention_mask = torch.tensor([[1] * 8, [0, 0, 0] + [1] * 5])  # padding_side="left"
    input_ids[1, :3] = 0
    with torch.no_grad():
        out = model(input_ids, attention_mask)
    print("fixed" if FIXED else "buggy", "last-token states", [round(v, 4) for v in out[:, -1].sum(-1).tolist()])


if __name__ == "__main__":
    main()
