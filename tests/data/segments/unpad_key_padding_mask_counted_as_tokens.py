"""An encoder that unpads a left-padded batch for a variable-length kernel, its padding mask the way
nn.MultiheadAttention takes it (`key_padding_mask`, True = padding; here (B, 1, 1, L)), its batch's lengths held as
`seq_lens`, written here after TransformerEngine#818 (the
same bug in another shape: its `attention_mask`, right padding, a softmax per document).

Buggy: the cumulative lengths and the gather indices are read off `key_padding_mask` itself (`mask.sum(-1)`,
`mask.flatten().nonzero()`), so the documents are each row's padding and the real tokens are never attended (their
output stays zero). Fixed (--fixed): both read off `~key_padding_mask`.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
FIXED = "--fixed" in sys.argv
DIM, HEADS = 16, 2


def varlen_attention(q, k, v, cu_seqlens):
    """A stand-in for flash_attn_varlen_func: (total, H, D) tokens, one SDPA call per document."""
    out = torch.zeros_like(q)
    for i in range(len(cu_seqlens) - 1):
        start, end = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        if end > start:
            piece = [x[start:end].transpose(0, 1)[None] for x in (q, k, v)]
            out[start:end] = F.scaled_dot_product_attention(*piece)[0].transpose(0, 1)
    return out


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x, key_padding_mask):
        batch, length, _ = x.shape
        pad = key_padding_mask[:, 0, 0]  # (B, 1, 1, L), as the layer broadcasts it over heads and queries
        tokens = ~pad if FIXED else pad
        seqlens = tokens.sum(-1, dtype=torch.int32)
        cu_seqlens = F.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
        indices = tokens.flatten().nonzero().flatten()
        q, k, v = self.qkv(x).view(batch * length, 3, HEADS, DIM // HEADS)[indices].unbind(1)
        packed = varlen_attention(q, k, v, cu_seqlens).reshape(-1, DIM)
        y = torch.zeros(batch * length, DIM)
        y[indices] = packed
        return x + self.out(y.view(batch, length, DIM))


def main():
    seq_lens = torch.tensor([5, 3, 4])
    length = int(seq_lens.max())
    input_ids = torch.zeros(3, length, dtype=torch.long)
    for row, n in enumerate(seq_lens.tolist()):
        input_ids[row, length - n:] = torch.randint(1, 50, (n,))
    key_padding_mask = (input_ids == 0)[:, None, None, :]
    embed = nn.Embedding(50, DIM)
    layers = nn.ModuleList(Layer() for _ in range(2))
    with torch.no_grad():
        x = embed(input_ids)
        for layer in layers:
            x = layer(x, key_padding_mask)
        pooled = x[:, -1]
    print("last token", pooled[:, :3])


if __name__ == "__main__":
    main()
