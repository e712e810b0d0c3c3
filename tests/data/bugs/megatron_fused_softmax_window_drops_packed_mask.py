"""Megatron-LM: the sliding-window branch of FusedScaleMaskSoftmax throws away the caller's mask.

Citation: NVIDIA/Megatron-LM#7039 (issue), fixed by NVIDIA/Megatron-LM#7040
("fix(fusions): compose caller mask with sliding-window mask instead of dropping it").

Bug: in ``megatron/core/fusions/fused_softmax.py::FusedScaleMaskSoftmax.forward_torch_softmax`` the
sliding-window branch unconditionally does ``mask = get_sliding_window_causal_mask(sq, sk, window_size)``,
so a padding mask (micro batch > 1) or a packed-sequence block-diagonal mask passed by the caller is
silently ignored on SWA layers: pad keys and keys of other packed documents are attended.
Fix: ``mask = mask | get_sliding_window_causal_mask(...)`` when a mask was given (both are boolean,
True = masked out), the window mask alone when it was not.

This program: the unfused ``DotProductAttention`` path (baddbmm scores -> FusedScaleMaskSoftmax torch
fallback -> bmm with values) for a micro batch of two packed rows of 8 tokens, each holding two
documents (lengths [5, 3] and [2, 6]), with the block-diagonal causal mask built from the document ids
(``[b, 1, sq, sk]``, True = masked) and ``config.window_size = (3, 0)``. With the bug the first tokens
of each second document attend the last tokens of the previous document inside the window.
"""
import math
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

FIXED = "--fixed" in sys.argv


@dataclass
class TransformerConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    window_size: Optional[Tuple[int, int]] = (3, 0)
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True


def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


def get_default_causal_mask(sq):
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def get_sliding_window_causal_mask(sq, skv, window_size):
    """Create the equivalent attention mask for SWA in [sq, skv] shape (True = masked)."""
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
    ml = ~ml
    return ml


class FusedScaleMaskSoftmax(torch.nn.Module):
    def __init__(self, attn_mask_type, mask_func, softmax_in_fp32, scale, window_size=None):
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale
        self.window_size = window_size

    def forward(self, input, mask):
        # the fused CUDA kernels are unavailable here: the torch fallback is the path under test
        return self.forward_torch_softmax(input, mask)

    def forward_torch_softmax(self, input, mask):
        if self.scale is not None:
            input = input * self.scale

        # Generate causal mask if not given
        sq, sk = input.size(2), input.size(3)
        if self.window_size is not None:
            sliding_window_mask = get_sliding_window_causal_mask(sq, sk, self.window_size)
            if FIXED and mask is not None:
                mask = mask | sliding_window_mask
            else:
                mask = sliding_window_mask
        elif self.attn_mask_type == "causal" and mask is None and sq > 1:
            assert sq == sk, "causal mask is only for self attention"
            mask = get_default_causal_mask(sq)

        mask_output = self.mask_func(input, mask) if mask is not None else input
        probs = torch.nn.Softmax(dim=-1)(mask_output)
        return probs


class DotProductAttention(torch.nn.Module):
    def __init__(self, config: TransformerConfig, attn_mask_type="causal"):
        super().__init__()
        self.config = config
        self.hidden_size_per_attention_head = config.hidden_size // config.num_attention_heads
        self.scale_mask_softmax = FusedScaleMaskSoftmax(
            attn_mask_type=attn_mask_type,
            mask_func=attention_mask_func,
            softmax_in_fp32=config.attention_softmax_in_fp32,
            scale=None,
            window_size=config.window_size,
        )
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)

    def forward(self, query, key, value, attention_mask):
        # query/key/value: [sq, b, np, hn]
        output_size = (query.size(1), query.size(2), query.size(0), key.size(0))
        query = query.reshape(output_size[2], output_size[0] * output_size[1], -1)
        key = key.view(output_size[3], output_size[0] * output_size[1], -1)
        matmul_result = torch.baddbmm(
            torch.empty(output_size[0] * output_size[1], output_size[2], output_size[3]),
            query.transpose(0, 1),
            key.transpose(0, 1).transpose(1, 2),
            beta=0.0,
            alpha=1.0 / self.norm_factor,
        )
        attention_scores = matmul_result.view(*output_size)
        attention_probs = self.scale_mask_softmax(attention_scores, attention_mask)

        value = value.view(value.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context = torch.bmm(attention_probs, value.transpose(0, 1))
        context = context.view(*output_size[:3], -1).permute(2, 0, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), -1)


def main():
    torch.manual_seed(0)
    config = TransformerConfig()
    attn = DotProductAttention(config)
    seq_len, doc_lengths = 8, [[5, 3], [2, 6]]
    b, np_, hn = len(doc_lengths), config.num_attention_heads, config.hidden_size // config.num_attention_heads

    # packed-sequence mask: a token sees earlier tokens of its own document; [b, 1, sq, sk], True = masked
    document_ids = torch.stack(
        [torch.repeat_interleave(torch.arange(len(d)), torch.tensor(d)) for d in doc_lengths]
    )
    same_doc = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    attention_mask = ~same_doc | get_default_causal_mask(seq_len)

    q, k, v = (torch.randn(seq_len, b, np_, hn) for _ in range(3))
    out = attn(q, k, v, attention_mask)
    print("context", tuple(out.shape), "norm %.4f" % out.norm())


if __name__ == "__main__":
    main()
