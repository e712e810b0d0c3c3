"""vLLM-Omni diffusion FLASH_ATTN: cross-attention unpads the query with the text key-padding mask.

Citation: vllm-project/vllm-omni issue #5865 ("FLASH_ATTN mishandles cross-attention key-padding masks
when query_len != key_len") and its fix, PR #5866 ("[Bugfix][Diffusion] Fix FLASH_ATTN cross-attention
key-padding unpad", merged). Both descriptions were read; the stored snapshot of the repository predates
them, so `_forward_varlen_masked` below is written from the descriptions, around the HF-derived
`_upad_input` / `_pad_input` helpers (backends/utils/fa.py) as transformers ships them.

Bug: `FlashAttentionImpl._forward_varlen_masked` hands the 2D key-padding mask to `_upad_input`, which
was written for self-attention. With query_len != key_len its else-branch slices
`attention_mask[:, -query_length:]` and runs `unpad_input(query, mask)`: indices computed on the
flattened [batch, key_len] mask pick rows of the flattened [batch, query_len] image query. Most image
queries are dropped (scattered back as zeros), and with batch >= 2 the kept rows belong to the wrong
sample, so they attend another sample's text keys.

Fix: when query_len != key_len keep the query dense (`cu_seqlens_q = arange(0, (B+1)*Lq, Lq)`), unpad
only K/V with the key mask, and reshape the output instead of `_pad_input`.

Reproduction: batch 2, 6 image-latent queries, a text prompt of 5 keys with 5 and 3 real tokens
(`encoder_attention_mask`). `flash_attn_varlen_func` is a CPU stand-in that runs SDPA on each
[cu_seqlens_q[i]:cu_seqlens_q[i+1]] x [cu_seqlens_k[i]:cu_seqlens_k[i+1]] segment, as the kernel does.
"""
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False):
    """CPU reference of the varlen kernel: sequence i is q/k/v rows [cu[i], cu[i+1])."""
    out = torch.zeros_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        if qe == qs:
            continue
        o = F.scaled_dot_product_attention(q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1),
                                           v[ks:ke].transpose(0, 1), is_causal=causal,
                                           scale=softmax_scale)
        out[qs:qe] = o.transpose(0, 1)
    return out


def _get_unpad_data(attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, max_seqlen_in_batch


def _index_first_axis(tensor, indices):
    return tensor.reshape(-1, *tensor.shape[2:])[indices]


def _unpad_input(hidden_states, attention_mask):
    indices, cu_seqlens, max_seqlen = _get_unpad_data(attention_mask)
    return _index_first_axis(hidden_states, indices), indices, cu_seqlens, max_seqlen


def _pad_input(hidden_states, indices, batch, seqlen):
    output = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype)
    output[indices] = hidden_states
    return output.view(batch, seqlen, *hidden_states.shape[1:])


def _upad_input(query_layer, key_layer, value_layer, attention_mask, query_length):
    indices_k, cu_seqlens_k, max_seqlen_in_batch_k = _get_unpad_data(attention_mask)
    batch_size, kv_seq_len = key_layer.shape[:2]
    key_layer = _index_first_axis(key_layer, indices_k)
    value_layer = _index_first_axis(value_layer, indices_k)
    if query_length == kv_seq_len:
        query_layer = _index_first_axis(query_layer, indices_k)
        cu_seqlens_q, max_seqlen_in_batch_q, indices_q = cu_seqlens_k, max_seqlen_in_batch_k, indices_k
    elif query_length == 1:
        max_seqlen_in_batch_q = 1
        cu_seqlens_q = torch.arange(batch_size + 1, dtype=torch.int32)
        indices_q = cu_seqlens_q[:-1]
        query_layer = query_layer.squeeze(1)
    else:
        # The -q_len: slice assumes left padding.
        attention_mask = attention_mask[:, -query_length:]
        query_layer, indices_q, cu_seqlens_q, max_seqlen_in_batch_q = _unpad_input(query_layer,
                                                                                   attention_mask)
    return (query_layer, key_layer, value_layer, indices_q, (cu_seqlens_q, cu_seqlens_k),
            (max_seqlen_in_batch_q, max_seqlen_in_batch_k))


@dataclass
class AttentionMetadata:
    attn_mask: Optional[torch.Tensor] = None  # [B, Lk] bool, True = real text token


class FlashAttentionImpl:
    def __init__(self, num_heads, head_size, softmax_scale, causal=False):
        self.num_heads, self.head_size = num_heads, head_size
        self.softmax_scale = softmax_scale
        self.causal = causal

    def forward(self, query, key, value, attn_metadata: Optional[AttentionMetadata] = None):
        if attn_metadata is not None and attn_metadata.attn_mask is not None:
            return self._forward_varlen_masked(query, key, value, attn_metadata.attn_mask)
        b, lq = query.shape[:2]
        lk = key.shape[1]
        out = flash_attn_varlen_func(
            query.reshape(b * lq, *query.shape[2:]), key.reshape(b * lk, *key.shape[2:]),
            value.reshape(b * lk, *value.shape[2:]),
            torch.arange(0, (b + 1) * lq, lq, dtype=torch.int32),
            torch.arange(0, (b + 1) * lk, lk, dtype=torch.int32), lq, lk,
            softmax_scale=self.softmax_scale, causal=self.causal)
        return out.view(b, lq, *out.shape[1:])

    def _forward_varlen_masked(self, query, key, value, attention_mask):
        batch_size, query_len = query.shape[:2]
        key_len = key.shape[1]
        if FIXED and query_len != key_len:
            # The mask describes keys only: keep every query row, unpad K/V alone.
            key_states, _, cu_seqlens_k, max_seqlen_k = _unpad_input(key, attention_mask)
            value_states, _, _, _ = _unpad_input(value, attention_mask)
            cu_seqlens_q = torch.arange(0, (batch_size + 1) * query_len, query_len, dtype=torch.int32)
            out = flash_attn_varlen_func(
                query.reshape(batch_size * query_len, *query.shape[2:]), key_states, value_states,
                cu_seqlens_q, cu_seqlens_k, query_len, max_seqlen_k,
                softmax_scale=self.softmax_scale, causal=self.causal)
            return out.view(batch_size, query_len, *out.shape[1:])
        q, k, v, indices_q, cu_seq_lens, max_seq_lens = _upad_input(query, key, value,
                                                                    attention_mask, query_len)
        cu_seqlens_q, cu_seqlens_k = cu_seq_lens
        max_seqlen_q, max_seqlen_k = max_seq_lens
        out_unpad = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k, softmax_scale=self.softmax_scale,
                                           causal=self.causal)
        return _pad_input(out_unpad, indices_q, batch_size, query_len)


class CrossAttention(nn.Module):
    """Prompt cross-attention of a DiT block (image latents attend to the text encoder states)."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.attn = FlashAttentionImpl(num_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask):
        b, lq, _ = hidden_states.shape
        lk = encoder_hidden_states.shape[1]
        q = self.to_q(hidden_states).view(b, lq, self.num_heads, self.head_dim)
        k = self.to_k(encoder_hidden_states).view(b, lk, self.num_heads, self.head_dim)
        v = self.to_v(encoder_hidden_states).view(b, lk, self.num_heads, self.head_dim)
        out = self.attn.forward(q, k, v, AttentionMetadata(attn_mask=encoder_attention_mask))
        return self.to_out(out.reshape(b, lq, -1))


def main():
    torch.manual_seed(0)
    dim, heads = 16, 2
    block = CrossAttention(dim, heads).eval()
    hidden_states = torch.randn(2, 6, dim)           # image latent tokens
    encoder_hidden_states = torch.randn(2, 5, dim)   # padded text prompt
    encoder_attention_mask = torch.tensor([[1, 1, 1, 1, 1],
                                           [1, 1, 1, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        out = block(hidden_states, encoder_hidden_states, encoder_attention_mask)
    zero_rows = int((out - block.to_out.bias).abs().sum(-1).lt(1e-6).sum())
    print("out", tuple(out.shape), "query rows left at zero", zero_rows)


if __name__ == "__main__":
    main()
