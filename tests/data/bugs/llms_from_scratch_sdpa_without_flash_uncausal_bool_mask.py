"""LLMs-from-scratch ch03 bonus: MHAPyTorchSDPAWithoutFlash passed the "future" mask as SDPA's keep-mask.

Citation: rasbt/LLMs-from-scratch#1061 ("Bug in Ch03 - Bonus02 - PyTorch's scaled dot product
attention without FlashAttention", closed), fixed by rasbt/LLMs-from-scratch#1062 ("Fix causal
mask in SDPA attention", merged: "invert the boolean mask passed to scaled_dot_product_attention so
tokens attend only to current and previous positions").  Read: the issue and PR descriptions; the
module is written from my knowledge of ch03/02_bonus_efficient-multihead-attention (the
mha-implementations notebook was not re-read here).

Bug: the module registers `mask = torch.triu(torch.ones(context_length, context_length),
diagonal=1).bool()` (True = future position, the convention of the notebook's other
implementations, which do `attn_scores.masked_fill_(mask_bool, -inf)`), then hands
`self.mask[:num_tokens, :num_tokens]` to `F.scaled_dot_product_attention(attn_mask=..., is_causal=False)`,
where True means "take part in attention": each token attends only to *future* tokens (and the
last row to nothing).
Fix (#1062): pass the inverted mask, `attn_mask=~attn_mask`.

Reproduction: the module as in the notebook (fused qkv, context_length=8), batch 2 of 6 tokens.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class MHAPyTorchSDPAWithoutFlash(nn.Module):
    def __init__(self, d_in, d_out, num_heads, context_length, dropout=0.0, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "embed_dim is indivisible by num_heads"
        self.num_heads = num_heads
        self.context_length = context_length
        self.head_dim = d_out // num_heads
        self.d_out = d_out
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.proj = nn.Linear(d_out, d_out)
        self.dropout = dropout
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1).bool())

    def forward(self, x):
        batch_size, num_tokens, embed_dim = x.shape
        # (b, num_tokens, embed_dim) --> (b, num_tokens, 3 * embed_dim)
        qkv = self.qkv(x)
        # (b, num_tokens, 3 * embed_dim) --> (b, num_tokens, 3, num_heads, head_dim)
        qkv = qkv.view(batch_size, num_tokens, 3, self.num_heads, self.head_dim)
        # (b, num_tokens, 3, num_heads, head_dim) --> (3, b, num_heads, num_tokens, head_dim)
        qkv = qkv.permute(2, 0, 3, 1, 4)
        queries, keys, values = qkv
        use_dropout = 0. if not self.training else self.dropout

        # Ensure attn_mask is compatible with expected shape and `batch_first=True`
        # No need to manually adjust for num_heads; ensure it's right for the sequence
        if self.context_length >= num_tokens:
            attn_mask = self.mask[:num_tokens, :num_tokens]
        else:
            attn_mask = self.mask[:self.context_length, :self.context_length]
        if FIXED:
            # SDPA's boolean mask: True = take part in attention
            attn_mask = ~attn_mask

        context_vec = nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=attn_mask, dropout_p=use_dropout, is_causal=False)
        # Combine heads, where self.d_out = self.num_heads * self.head_dim
        context_vec = context_vec.transpose(1, 2).contiguous().view(batch_size, num_tokens, self.d_out)
        return self.proj(context_vec)


def main():
    torch.manual_seed(123)
    context_length, embed_dim = 8, 16
    embeddings = torch.randn((2, 6, embed_dim))
    mha = MHAPyTorchSDPAWithoutFlash(d_in=embed_dim, d_out=embed_dim, context_length=context_length,
                                     dropout=0.0, num_heads=2, qkv_bias=False).eval()
    with torch.no_grad():
        out = mha(embeddings)
    print(out.shape, "first-token output", round(out[0, 0].sum().item(), 4))


if __name__ == "__main__":
    main()
