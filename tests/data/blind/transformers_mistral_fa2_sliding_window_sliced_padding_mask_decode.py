"""transformers Mistral FlashAttention-2: decode past the window slices the 2-D padding mask, not the keys.

Citation: huggingface/transformers PR #34093 "Fix FA2 attention for models supporting sliding window"
(merged, 2024-10). Pre-fix code as in `MistralFlashAttention2.forward` (same block in Qwen2,
Starcoder2, Mixtral) of transformers 4.45.

Bug: with a cache that already has contents and `kv_seq_len > config.sliding_window`, the FA2 forward
sliced `past_key` / `past_value` to the last `sliding_window - 1` slots into local variables that are
never used, but sliced the 2-D padding `attention_mask` the same way (`attention_mask[:, 1 -
sliding_window:]` plus a column of ones). The keys handed to `_flash_attention_forward` keep the full
cache length, so `_upad_input` gathers keys with indices computed from a mask of the wrong width
(`batch_size * kv_seq_len` rows indexed by positions of a `batch_size * sliding_window` mask): each
query attends to the wrong cache slots, and a later row of the batch reads keys of an earlier row.
The mask is only 2-D (and so only reaches this path) when the batch is padded, e.g. left-padded
generation.

Fix: the PR removed the slicing snippet; the full 2-D mask is unpadded against the full keys and the
window is left to `_flash_attention_forward(sliding_window=...)` (flash `window_size`).

This program: a left-padded batch of two prompts, prefill then one decode step through a
`DynamicCache`-like cache, `sliding_window=4`. `flash_attn_varlen_func` is a CPU stand-in that runs
`F.scaled_dot_product_attention` per sequence of `cu_seqlens_q/k` with bottom-right causal alignment
and flash's `window_size=(left, right)`. Pre-fix lines were written from the snippet the PR removed
(quoted in its description) and transformers 4.45's `_flash_attention_forward` / `_upad_input` as
known; RoPE is omitted.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class MistralConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    sliding_window: int = 4


class DynamicCache:
    def __init__(self):
        self.key_cache, self.value_cache = [], []

    def __getitem__(self, layer_idx):
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx=0):
        return 0 if len(self.key_cache) <= layer_idx else self.key_cache[layer_idx].shape[-2]

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """CPU stand-in for flash_attn's varlen kernel (bottom-right aligned causal / local masks)."""
    outs = []
    for b in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]].transpose(0, 1)
        ks = k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]].transpose(0, 1)
        vs = v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]].transpose(0, 1)
        sq, sk = qs.shape[1], ks.shape[1]
        i = torch.arange(sq)[:, None] + (sk - sq)
        j = torch.arange(sk)[None, :]
        allowed = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            allowed &= j <= i
        left, right = window_size
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed).transpose(0, 1))
    return torch.cat(outs, dim=0)


def _get_unpad_data(attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, max_seqlen_in_batch


def _upad_input(query_layer, key_layer, value_layer, attention_mask, query_length):
    indices_k, cu_seqlens_k, max_seqlen_in_batch_k = _get_unpad_data(attention_mask)
    batch_size, kv_seq_len, num_key_value_heads, head_dim = key_layer.shape
    key_layer = key_layer.reshape(batch_size * kv_seq_len, num_key_value_heads, head_dim)[indices_k]
    value_layer = value_layer.reshape(batch_size * kv_seq_len, num_key_value_heads, head_dim)[indices_k]
    if query_length == kv_seq_len:
        query_layer = query_layer.reshape(batch_size * kv_seq_len, -1, head_dim)[indices_k]
        cu_seqlens_q, max_seqlen_in_batch_q, indices_q = cu_seqlens_k, max_seqlen_in_batch_k, indices_k
    elif query_length == 1:
        max_seqlen_in_batch_q = 1
        cu_seqlens_q = torch.arange(batch_size + 1, dtype=torch.int32)
        indices_q = cu_seqlens_q[:-1]
        query_layer = query_layer.squeeze(1)
    else:
        raise NotImplementedError("chunked decode is not exercised here")
    return (query_layer, key_layer, value_layer, indices_q, (cu_seqlens_q, cu_seqlens_k),
            (max_seqlen_in_batch_q, max_seqlen_in_batch_k))


def pad_input(hidden_states, indices, batch, seqlen):
    output = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    output[indices] = hidden_states
    return output.view(batch, seqlen, *hidden_states.shape[1:])


def _flash_attention_forward(query_states, key_states, value_states, attention_mask, query_length,
                             is_causal, dropout=0.0, sliding_window=None):
    causal = is_causal
    use_sliding_windows = sliding_window is not None and key_states.shape[1] > sliding_window
    flash_kwargs = {"window_size": (sliding_window, sliding_window)} if use_sliding_windows else {}
    batch_size = query_states.shape[0]
    query_states, key_states, value_states, indices_q, cu_seq_lens, max_seq_lens = _upad_input(
        query_states, key_states, value_states, attention_mask, query_length
    )
    cu_seqlens_q, cu_seqlens_k = cu_seq_lens
    max_seqlen_in_batch_q, max_seqlen_in_batch_k = max_seq_lens
    attn_output_unpad = flash_attn_varlen_func(
        query_states, key_states, value_states, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_in_batch_q, max_seqlen_k=max_seqlen_in_batch_k,
        dropout_p=dropout, causal=causal, **flash_kwargs,
    )
    return pad_input(attn_output_unpad, indices_q, batch_size, query_length)


def repeat_kv(hidden_states, n_rep):
    return hidden_states.repeat_interleave(n_rep, dim=1)


class MistralFlashAttention2(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, cache_position=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += int(cache_position[0])

        if past_key_value is not None:
            if not FIXED:
                # Activate slicing cache only if the config has a value `sliding_windows` attribute
                cache_has_contents = past_key_value.get_seq_length(self.layer_idx) > 0
                if (
                    getattr(self.config, "sliding_window", None) is not None
                    and kv_seq_len > self.config.sliding_window
                    and cache_has_contents
                ):
                    slicing_tokens = 1 - self.config.sliding_window

                    past_key = past_key_value[self.layer_idx][0]
                    past_value = past_key_value[self.layer_idx][1]

                    past_key = past_key[:, :, slicing_tokens:, :].contiguous()
                    past_value = past_value[:, :, slicing_tokens:, :].contiguous()

                    if past_key.shape[-2] != self.config.sliding_window - 1:
                        raise ValueError("past key must have a shape of (`batch_size, num_heads, self.config.sliding_window-1, head_dim`)")

                    if attention_mask is not None:
                        attention_mask = attention_mask[:, slicing_tokens:]
                        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, -1:])], dim=-1)

            key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)

        attn_output = _flash_attention_forward(
            query_states, key_states, value_states, attention_mask, q_len,
            is_causal=self.is_causal, sliding_window=getattr(self.config, "sliding_window", None),
        )
        attn_output = attn_output.reshape(bsz, q_len, -1).contiguous()
        return self.o_proj(attn_output)


def main():
    torch.manual_seed(0)
    config = MistralConfig()
    attn = MistralFlashAttention2(config).eval()
    # left-padded prompts of 6 and 4 tokens (padding_side="left")
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    prompt = torch.randn(2, 6, config.hidden_size)
    cache = DynamicCache()
    with torch.no_grad():
        attn(prompt, attention_mask=attention_mask, past_key_value=cache, cache_position=torch.arange(6))
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(2, 1)], dim=-1)
        step = torch.randn(2, 1, config.hidden_size)
        out = attn(step, attention_mask=attention_mask, past_key_value=cache, cache_position=torch.tensor([6]))
    print("fixed" if FIXED else "buggy", "decode out", [round(v, 4) for v in out.sum(dim=(1, 2)).tolist()])


if __name__ == "__main__":
    main()
