# Written another way than TransformerEngine#629: a hand-written decoder whose mask helper builds the causal mask
# for a KV cache (queries at the end of the keys, `tril(diagonal=k_len - q_len)`) and whose block hands the same
# helper's mask to its cross-attention (`is_cross_attention = True`) over a padded encoder memory; --fixed gives the
# cross-attention only the memory's padding mask.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def make_mask(q_len, k_len, key_padding=None):
    """Bool (b, 1, q_len, k_len), True = attend: causal with the queries at the end of the keys (a cache's layout)."""
    keep = torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)[None, None]
    if key_padding is not None:
        keep = keep & key_padding[:, None, None, :]
    return keep


class Attention(nn.Module):
    def __init__(self, dim, heads, is_cross_attention=False):
        super().__init__()
        self.heads, self.is_cross_attention = heads, is_cross_attention
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, memory=None, mask=None):
        b, n, d = x.shape
        source = memory if self.is_cross_attention else x
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(source).view(b, source.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class DecoderBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.self_attn = Attention(dim, heads)
        self.cross_attn = Attention(dim, heads, is_cross_attention=True)

    def forward(self, x, memory, memory_real):
        x = x + self.self_attn(x, mask=make_mask(x.shape[1], x.shape[1]))
        if FIXED:
            cross_mask = memory_real[:, None, None, :]
        else:
            cross_mask = make_mask(x.shape[1], memory.shape[1], memory_real)
        return x + self.cross_attn(x, memory=memory, mask=cross_mask)


def main():
    torch.manual_seed(0)
    dim, heads = 16, 2
    block = DecoderBlock(dim, heads).eval()
    memory_lengths = torch.tensor([7, 5])
    memory = torch.randn(2, 7, dim)
    memory_real = torch.arange(7)[None, :] < memory_lengths[:, None]
    target = torch.randn(2, 3, dim)
    with torch.no_grad():
        out = block(target, memory, memory_real)
    print(f"decoder output norm: {out.norm().item():.4f}")


if __name__ == "__main__":
    main()
