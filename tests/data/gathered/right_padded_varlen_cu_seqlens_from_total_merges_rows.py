"""A padding-free encoder path written another way: a right-padded batch is unpadded (`index_select` of the flattened
tokens where `attention_mask` is 1) for a varlen kernel, whose stand-in runs `is_causal=True` SDPA per
[cu_seqlens[i], cu_seqlens[i + 1]) segment. The bug: cu_seqlens is built from the batch's total token count alone,
`[0, attention_mask.sum()]`, one segment, so the second row's tokens attend the first row's as if they were its
earlier tokens. `--fixed` builds `F.pad(attention_mask.sum(1).cumsum(0), (1, 0))`, a segment per row; the output is
then checked against each row run alone.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def varlen_attention(q, k, v, cu_seqlens):
    """(total, H, D) tensors, one causal attention per segment (flash_attn_varlen_func's semantics, causal=True)."""
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qi, ki, vi = (t[start:end].transpose(0, 1) for t in (q, k, v))  # (H, n, D)
        out[start:end] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).transpose(0, 1)
    return out


class Layer(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, hidden, attention_mask):
        b, n, d = hidden.shape
        q, k, v = self.qkv(hidden).view(b, n, 3, self.heads, -1).unbind(2)  # (B, L, H, D)
        indices = attention_mask.flatten().nonzero().flatten()
        if FIXED:
            cu_seqlens = F.pad(attention_mask.sum(1).cumsum(0), (1, 0))
        else:
            cu_seqlens = torch.tensor([0, int(attention_mask.sum())])
        packed = [t.reshape(b * n, self.heads, -1).index_select(0, indices) for t in (q, k, v)]
        out = varlen_attention(*packed, cu_seqlens)
        full = torch.zeros(b * n, self.heads, d // self.heads).index_copy(0, indices, out)
        return hidden + self.proj(full.view(b, n, d))


def main():
    layer = Layer().eval()
    lengths = [5, 3]
    hidden = torch.randn(2, 6, 16)
    attention_mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    with torch.no_grad():
        out = layer(hidden, attention_mask)
        alone = [layer(hidden[i:i + 1, :n], torch.ones(1, n, dtype=torch.long)) for i, n in enumerate(lengths)]
    same = all(torch.allclose(out[i, :n], alone[i][0], atol=1e-5) for i, n in enumerate(lengths))
    print("rows as run alone:", same)


if __name__ == "__main__":
    main()
