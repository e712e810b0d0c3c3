"""Transformer Engine: FusedAttention hands `window_size` to cuDNN, whose left bound is exclusive.

Citation: NVIDIA/TransformerEngine PR #1212, "Fix cuDNN sliding window size" (merged, fixes issue
#1197; PR description read, diff not re-read, so the code below is a small port written from it).

Bug: TE's `window_size=(left, right)` means query i attends keys [i - left, i + right] (FlashAttention's
convention, which FlashAttention and UnfusedDotProductAttention follow). cuDNN's sliding window is
(i - window_size_left, i], exclusive of the i - left key. FusedAttention passed `window_size` through
unchanged, so the cuDNN backend saw one key fewer on the left than the other backends.

Fix: FusedAttention passes `window_size_left + 1` to cuDNN, giving the same [i - left, i] window.

Reproduction: a THD (packed, `cu_seqlens`) batch of two sequences (lengths 7 and 5), attn_mask_type
"padding_causal", window_size (2, 0). `fused_attn_fwd` stands in for the cuDNN kernel with cuDNN's
exclusive-left semantics; per sequence it builds the boolean window and calls SDPA.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def fused_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_kv, attn_scale, qkv_layout, attn_mask_type,
                   window_size):
    """cuDNN-semantics kernel: query i sees keys in (i - window_size[0], i + window_size[1]]."""
    assert qkv_layout == "thd_thd_thd"
    out = torch.empty_like(q)
    left, right = window_size
    if "causal" in attn_mask_type:
        right = 0
    for b in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_kv[b]), int(cu_seqlens_kv[b + 1])
        i = torch.arange(qe - qs).view(-1, 1) + (ke - ks) - (qe - qs)
        j = torch.arange(ke - ks).view(1, -1)
        keep = torch.ones(qe - qs, ke - ks, dtype=torch.bool)
        if left >= 0:
            keep &= j > i - left
        if right >= 0:
            keep &= j <= i + right
        qb, kb, vb = (t.transpose(0, 1) for t in (q[qs:qe], k[ks:ke], v[ks:ke]))  # [h, s, d]
        out[qs:qe] = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=keep,
                                                    scale=attn_scale).transpose(0, 1)
    return out


class FusedAttention(nn.Module):
    def __init__(self, softmax_scale, attention_type="self"):
        super().__init__()
        self.softmax_scale = softmax_scale
        self.attention_type = attention_type

    def forward(self, query_layer, key_layer, value_layer, qkv_layout, cu_seqlens_q, cu_seqlens_kv,
                attn_mask_type, window_size):
        if FIXED and window_size is not None and window_size[0] >= 0:
            # cuDNN excludes the i - left key; widen by one to keep TE's inclusive [i - left, i].
            window_size = (window_size[0] + 1, window_size[1])
        return fused_attn_fwd(query_layer, key_layer, value_layer, cu_seqlens_q, cu_seqlens_kv,
                              self.softmax_scale, qkv_layout, attn_mask_type, window_size)


class DotProductAttention(nn.Module):
    def __init__(self, num_attention_heads, kv_channels, attn_mask_type="causal", window_size=None,
                 qkv_format="thd"):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.hidden_size_per_attention_head = kv_channels
        self.attn_mask_type = attn_mask_type
        self.window_size = window_size
        self.qkv_format = qkv_format
        self.fused_attention = FusedAttention(softmax_scale=kv_channels ** -0.5)

    def forward(self, query_layer, key_layer, value_layer, cu_seqlens_q=None, cu_seqlens_kv=None,
                attn_mask_type=None, window_size=None):
        attn_mask_type = attn_mask_type or self.attn_mask_type
        window_size = window_size if window_size is not None else self.window_size
        qkv_layout = "_".join([self.qkv_format] * 3)
        out = self.fused_attention(query_layer, key_layer, value_layer, qkv_layout, cu_seqlens_q,
                                   cu_seqlens_kv, attn_mask_type, window_size)
        return out.reshape(out.shape[0], -1)


def main():
    torch.manual_seed(0)
    heads, head_dim = 2, 8
    seqlens = torch.tensor([7, 5], dtype=torch.int32)
    cu_seqlens = F.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    total = int(cu_seqlens[-1])
    hidden = torch.randn(total, heads * head_dim)
    qkv_proj = nn.Linear(heads * head_dim, 3 * heads * head_dim)
    q, k, v = qkv_proj(hidden).view(total, 3, heads, head_dim).unbind(1)
    attn = DotProductAttention(heads, head_dim, attn_mask_type="padding_causal", window_size=(2, 0))
    with torch.no_grad():
        out = attn(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)
    print("out", tuple(out.shape), "sum %.4f" % out.sum().item())


if __name__ == "__main__":
    main()
