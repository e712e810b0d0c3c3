"""xformers ScaledDotProduct(causal=True) drops the causal mask when no att_mask is passed.

Citation: facebookresearch/xformers#103 ("[bug] Causal mask is skipped if no att_mask is
passed"), fixed by PR #104, commit 1328ba7c ("[bugfix] Causal mask being skipped if no extra
mask"). Read from the upstream git history (parent of 1328ba7c and the commit itself).

Bug, two parts fixed together in that commit:
1. ScaledDotProduct.forward only merged ``self.mask`` (the registered causal mask) into
   ``att_mask`` inside ``if att_mask is not None:``; with no extra mask, ``att_mask`` stayed
   None and the core ran full bidirectional attention although the config said causal=True.
2. Attention._get_causal_mask built ``tril(ones)`` and then did
   ``causal_mask[self._causal_mask == 1] = -inf`` -- comparing the *cached* attribute (None),
   so nothing became -inf and the "causal" additive mask was 0/1 everywhere.

Fix: build ``triu(ones * -inf, diagonal=1)`` and add ``else: att_mask = self.mask`` (plus a
deferred build when seq_len was not known at init).

This program: the microGPT-style usage -- ScaledDotProductConfig(causal=True, seq_len=BLOCK),
heads folded into the batch (B x nh, S, hs), no att_mask -- with the core written as in
xformers/components/attention/core.py at that time (matmul, additive mask, torch.softmax;
triton absent, as on CPU).
"""
import sys
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


# --- xformers/components/attention/core.py (CPU path) ---
def _softmax(a: torch.Tensor, causal: bool = False) -> torch.Tensor:
    # triton_softmax(a, causal=causal) is only used when triton is available
    return torch.softmax(a, dim=a.ndim - 1)


def scaled_query_key_softmax(q, k, att_mask, causal=False):
    q = q / (k.size(-1) ** 0.5)
    att = q @ k.transpose(-2, -1)
    if att_mask is not None and att_mask.dtype == torch.bool:
        att = att.masked_fill(~att_mask, float("-inf"))
    elif att_mask is not None:
        att = att + att_mask
    return _softmax(att, causal=causal)


def scaled_dot_product_attention(q, k, v, att_mask, dropout=None, causal=False):
    if att_mask is not None and q.shape[-2] == k.shape[-2] and q.shape[-2] < att_mask.shape[1]:
        seq = q.shape[-2]
        att_mask = att_mask[:, :seq, :seq]
    att = scaled_query_key_softmax(q, k, att_mask=att_mask, causal=causal)
    if dropout is not None:
        att = dropout(att)
    return att @ v


# --- xformers/components/attention/base.py ---
@dataclass
class AttentionConfig:
    name: str
    dropout: float


class Attention(nn.Module):
    _causal_mask: Optional[torch.Tensor] = None

    @classmethod
    def from_config(cls, config):
        fields = {k: v for k, v in asdict(config).items() if v is not None}
        return cls(**fields)

    def _get_causal_mask(self, seq_len: int, to_seq_len: int) -> torch.Tensor:
        # Cache a mask so that multiple instances would reuse the same
        causal_mask = self._causal_mask
        if not causal_mask:
            if FIXED:
                causal_mask = torch.triu(torch.ones(seq_len, to_seq_len) * float("-inf"), diagonal=1)
            else:
                causal_mask = torch.tril(torch.ones(seq_len, to_seq_len), diagonal=0)
                causal_mask[self._causal_mask == 1] = -float("inf")
            causal_mask.unsqueeze_(0)  # batch dimension
            self._causal_mask = causal_mask
        return causal_mask


# --- xformers/components/attention/scaled_dot_product.py ---
@dataclass
class ScaledDotProductConfig(AttentionConfig):
    causal: Optional[bool]
    seq_len: Optional[int]
    to_seq_len: Optional[int]


class ScaledDotProduct(Attention):
    mask: Optional[torch.Tensor]

    def __init__(self, dropout=0.0, causal=False, seq_len=None, to_seq_len=None, *args, **kwargs):
        super().__init__()
        self.attn_drop = nn.Dropout(dropout, inplace=False)
        self.causal = causal
        self.seq_len = seq_len
        if causal and seq_len is not None:
            mask = self._get_causal_mask(seq_len, to_seq_len if to_seq_len else seq_len)
            self.register_buffer("mask", mask)
        else:
            self.mask = None

    def forward(self, q, k, v, att_mask=None, *args, **kwargs):
        if FIXED and self.causal and self.mask is None:
            self.mask = self._get_causal_mask(q.shape[-2], q.shape[-2])
        # Mask-aware attention
        if self.mask is not None:
            self.mask = self.mask.to(q.dtype)
            if att_mask is not None:
                if att_mask.ndim == 2:
                    att_mask.unsqueeze_(0)
                if att_mask.dtype == torch.bool:
                    mask_merge = self.mask.clone()
                    mask_merge.masked_fill_(~att_mask, float("-inf"))
                    att_mask = mask_merge
                else:
                    att_mask = self.mask + att_mask
            elif FIXED:
                # If no additional mask is being passed, causal mask prevails
                att_mask = self.mask
            if att_mask is not None:
                att_mask = att_mask.to(q.dtype)
        return scaled_dot_product_attention(
            q=q, k=k, v=v, att_mask=att_mask, dropout=self.attn_drop, causal=self.causal
        )


def main():
    torch.manual_seed(0)
    BLOCK, BATCH, N_HEADS, HEAD_DIM = 16, 2, 2, 8
    config = ScaledDotProductConfig(name="scaled_dot_product", dropout=0.0, causal=True,
                                    seq_len=BLOCK, to_seq_len=None)
    attention = ScaledDotProduct.from_config(config)
    q, k, v = (torch.randn(BATCH * N_HEADS, BLOCK, HEAD_DIM) for _ in range(3))
    y = attention(q, k, v)  # GPT block: no extra mask, causality comes from the config
    # does position 0 depend on the future? perturb the last token's value
    v2 = v.clone()
    v2[:, -1] += 1.0
    leak = (attention(q, k, v2)[:, 0] - y[:, 0]).abs().max().item()
    print(f"causal={config.causal} leak of last token into position 0: {leak:.4f}")


if __name__ == "__main__":
    main()
