"""ExLlamaV2 batched generation with padding: -inf causal triangle makes padded query rows NaN.

Citation: turboderp/exllamav2 commit 586f25c ("Prevent nan in attn when using
padding tokens"), read in the upstream git history (exllamav2/attn.py).

Bug: `ExLlamaV2Attention.Params.build_single_attn_mask` filled the causal
triangle with `float("-inf")` and then took `torch.minimum` with the
tokenizer's `padding_mask` (pad positions -65505*2 cast to half, i.e. -inf).
With left padding, the first query rows of a padded sequence can only see pad
keys, so their whole row is -inf and softmax returns NaN. Those NaN hidden
states become NaN keys/values in the next layer and in the cache, and
`softmax(...) @ V` with a zero weight on a NaN value is still NaN, so the real
tokens of the padded sequence turn NaN as well.

Fix: the causal triangle uses -65504.0 (the fp16 minimum) instead of -inf, so
no row is entirely -inf.

This program: `Params` (input_mask, past_len, `build_single_attn_mask`), the
tokenizer's `padding_mask`, and the torch matmul attention path of
`ExLlamaV2Attention.forward` (taken whenever `input_mask` is given) with a KV
cache, in a 2-layer model; a left-padded batch is prefilled, then one decode
step runs. Compute is float32 on CPU (upstream runs fp16) and RoPE is left
out; neither changes which keys a query sees.
"""
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class ExLlamaV2Tokenizer:
    pad_token_id = 0

    def padding_mask(self, ids):
        mask_bool = (ids == self.pad_token_id)
        mask = mask_bool.int()
        mask *= -65505 * 2
        mask = mask.half()
        return mask


class Params:
    def __init__(self, batch_size, seq_len, past_len, input_mask, position_offsets=None):
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.past_len = past_len
        self.input_mask = input_mask
        self.position_offsets = position_offsets
        self.attn_mask = None

    def is_causal(self):
        return self.input_mask is None

    def get_attn_mask(self, device):
        if self.attn_mask is None:
            self.attn_mask = self.build_attn_mask(device)
        return self.attn_mask

    def build_single_attn_mask(self, batch_size, seq_len, past_len, device, input_mask):
        attn_mask = torch.zeros((batch_size, 1, seq_len, past_len + seq_len), dtype=torch.float16, device=device)
        if FIXED:
            attn_mask_triu = torch.triu(torch.full((seq_len - 1, seq_len - 1), -65504.0))
        else:
            attn_mask_triu = torch.triu(torch.full((seq_len - 1, seq_len - 1), float("-inf")))
        attn_mask[:, :, : seq_len - 1, past_len + 1: past_len + seq_len] = attn_mask_triu

        if input_mask is not None:
            min_mask_width = min(input_mask.shape[-1], seq_len + past_len)
            input_mask_part = input_mask[:, :min_mask_width].to(attn_mask.device)
            input_mask_part = input_mask_part.unsqueeze(1).unsqueeze(2)
            attn_mask[:, :, :, :min_mask_width] = torch.minimum(attn_mask[:, :, :, :min_mask_width], input_mask_part)
        return attn_mask

    def build_attn_mask(self, device):
        if self.input_mask is None and self.seq_len == 1:
            return None
        return self.build_single_attn_mask(self.batch_size, self.seq_len, self.past_len, device, self.input_mask)


class ExLlamaV2Cache:
    def __init__(self, num_layers, batch_size, max_seq_len, num_kv_heads, head_dim):
        self.key_states = [torch.zeros(batch_size, max_seq_len, num_kv_heads, head_dim) for _ in range(num_layers)]
        self.value_states = [torch.zeros(batch_size, max_seq_len, num_kv_heads, head_dim) for _ in range(num_layers)]
        self.current_seq_len = 0

    def get_kv_state(self, layer_idx, batch_size, a, b):
        return self.key_states[layer_idx], self.value_states[layer_idx]


class ExLlamaV2Attention(nn.Module):
    def __init__(self, hidden_size, num_heads, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.input_layernorm = nn.LayerNorm(hidden_size)
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, cache=None, attn_params=None, past_len=None):
        batch_size, q_len, _ = hidden_states.shape
        residual = hidden_states
        post_norm = self.input_layernorm(hidden_states)
        query_states = self.q_proj(post_norm).view(batch_size, q_len, self.num_heads, self.head_dim)
        key_states = self.k_proj(post_norm).view(batch_size, q_len, self.num_heads, self.head_dim)
        value_states = self.v_proj(post_norm).view(batch_size, q_len, self.num_heads, self.head_dim)

        if cache is not None:
            batch_keys, batch_values = cache.get_kv_state(self.layer_idx, batch_size, 0, past_len)
            batch_keys.narrow(1, past_len, q_len).narrow(0, 0, batch_size).copy_(key_states)
            batch_values.narrow(1, past_len, q_len).narrow(0, 0, batch_size).copy_(value_states)
            key_states = batch_keys.narrow(1, 0, past_len + q_len).narrow(0, 0, batch_size)
            value_states = batch_values.narrow(1, 0, past_len + q_len).narrow(0, 0, batch_size)

        # Torch matmul attention (the path taken whenever an input_mask is given)
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2).transpose(-1, -2)
        value_states = value_states.transpose(1, 2)
        attn_weights = torch.matmul(query_states, key_states)
        attn_weights /= math.sqrt(self.head_dim)
        attn_mask = attn_params.get_attn_mask(hidden_states.device)
        if attn_mask is not None:
            attn_weights = attn_weights + attn_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(batch_size, q_len, self.num_heads * self.head_dim)
        return self.o_proj(attn_output) + residual


def main():
    torch.manual_seed(0)
    hidden, heads, vocab, layers = 32, 4, 40, 2
    tokenizer = ExLlamaV2Tokenizer()
    embed = nn.Embedding(vocab, hidden)
    blocks = [ExLlamaV2Attention(hidden, heads, i) for i in range(layers)]
    head = nn.Linear(hidden, vocab, bias=False)

    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = tokenizer.padding_mask(ids)
    position_offsets = torch.tensor([[-(width - len(p))] for p in prompts])
    cache = ExLlamaV2Cache(layers, len(prompts), 16, heads, hidden // heads)

    with torch.no_grad():
        # Prefill
        params = Params(len(prompts), width, 0, mask, position_offsets)
        x = embed(ids)
        for block in blocks:
            x = block(x, cache, params, past_len=0)
        next_ids = head(x[:, -1]).nan_to_num().argmax(-1, keepdim=True)
        # One decode step: the mask grows by one real column
        mask = torch.cat([mask, torch.zeros_like(next_ids, dtype=torch.half)], dim=1)
        params = Params(len(prompts), 1, width, mask, position_offsets)
        x = embed(next_ids)
        for block in blocks:
            x = block(x, cache, params, past_len=width)
        logits = head(x[:, -1])
    print("fixed" if FIXED else "buggy", "decode logits finite per sequence:",
          torch.isfinite(logits).all(-1).tolist())


if __name__ == "__main__":
    main()
