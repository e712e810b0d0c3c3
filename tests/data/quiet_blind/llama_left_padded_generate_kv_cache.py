"""Greedy batched generation with LEFT padding and a growing KV cache (Llama / HF generate style).

Follows huggingface/transformers generation/utils.py (prepare_inputs_for_generation: position_ids =
attention_mask.long().cumsum(-1) - 1, masked_fill(attention_mask == 0, 1); attention_mask grows by one
column of ones per step) and models/llama/modeling_llama.py (sdpa_attention_forward with a boolean mask).
Mask meant: prefill is causal AND hides the left pad columns of the shorter prompt; each decode step's
single query sees every real cached key (never the pads) and itself.
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, position_ids, attention_mask, past_key_value):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, position_ids), apply_rotary(k, position_ids)
        if past_key_value:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1)), (k, v)


def apply_rotary(x, position_ids, base=10000.0):
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (base ** (torch.arange(half, dtype=torch.float32) / half))
    freqs = position_ids[:, None, :, None].float() * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def update_causal_mask(attention_mask, q_len, past_len):
    """Bool [bs,1,q_len,kv_len]: key j visible to query i iff j <= past_len+i and column j is not padding."""
    kv_len = attention_mask.shape[1]
    cache_position = torch.arange(past_len, past_len + q_len)
    causal = torch.arange(kv_len)[None, :] <= cache_position[:, None]
    return causal[None, None] & attention_mask[:, None, None, :].bool()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_new_tokens", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    vocab, hidden, heads, pad_token_id = 64, 32, 4, 0
    embed_tokens, attn, lm_head = nn.Embedding(vocab, hidden), LlamaAttention(hidden, heads), nn.Linear(hidden, vocab)

    # tokenizer(padding_side="left")
    input_ids = torch.tensor([[3, 4, 5, 6, 7, 8], [pad_token_id, pad_token_id, pad_token_id, 9, 10, 11]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]])

    past, past_len, cur = None, 0, input_ids
    with torch.no_grad():
        for _ in range(args.max_new_tokens):
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            position_ids = position_ids[:, -cur.shape[1]:]
            mask = update_causal_mask(attention_mask, cur.shape[1], past_len)
            h, past = attn(embed_tokens(cur), position_ids, mask, past)
            past_len += cur.shape[1]
            next_tokens = lm_head(h[:, -1]).argmax(-1)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((2, 1))], dim=-1)
            cur = next_tokens[:, None]
    print(input_ids.tolist())


if __name__ == "__main__":
    main()
