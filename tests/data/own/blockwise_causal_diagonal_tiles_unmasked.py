"""Written for maskcli (the same bug as memory-efficient-attention-pytorch adf5751, another way): a flash-style
blockwise attention with an online softmax, its module flagged `is_causal`, that skips the key blocks after each query
block but never masks inside the diagonal blocks, so every query sees the later keys of its own block. Left-padded
batch, key padding by an additive mask, tiles sliced with indexing (not split). --fixed: a triangle on the diagonal."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class BlockwiseSelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, block: int):
        super().__init__()
        self.n_heads, self.block, self.is_causal = n_heads, block, True
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        H, D, bs = self.n_heads, C // self.n_heads, self.block
        q, k, v = self.qkv(x).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)  # each (B, H, L, D), views of one tensor
        q = q * D ** -0.5
        bias = torch.zeros(B, 1, 1, L).masked_fill(key_padding_mask[:, None, None, :], torch.finfo(x.dtype).min)
        out = torch.empty_like(q)
        for i in range(0, L, bs):
            qi = q[:, :, i:i + bs]
            m = torch.full(qi.shape[:-1], float("-inf"))
            denom = torch.zeros(qi.shape[:-1])
            acc = torch.zeros_like(qi)
            for j in range(0, i + bs, bs):  # key blocks after the query block are skipped whole
                kj, vj = k[:, :, j:j + bs], v[:, :, j:j + bs]
                s = qi @ kj.transpose(-2, -1) + bias[..., j:j + bs]
                if self.is_causal and j == i and FIXED:
                    tri = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).triu(1)
                    s = s.masked_fill(tri, torch.finfo(s.dtype).min)
                m_new = torch.maximum(m, s.amax(dim=-1))
                p = torch.exp(s - m_new[..., None])
                scale = torch.exp(m - m_new)
                denom = denom * scale + p.sum(dim=-1)
                acc = acc * scale[..., None] + p @ vj
                m = m_new
            out[:, :, i:i + bs] = acc / denom[..., None]
        return self.proj(out.transpose(1, 2).reshape(B, L, C))


torch.manual_seed(0)
attn = BlockwiseSelfAttention(dim=24, n_heads=3, block=4).eval()
lengths = [10, 12]
L = max(lengths)
x = torch.randn(len(lengths), L, 24)
pad = torch.arange(L)[None, :] < (L - torch.tensor(lengths))[:, None]  # True = padding, on the left
with torch.no_grad():
    y = attn(x, pad)
    q, k, v = attn.qkv(x).view(2, L, 3, 3, 8).permute(2, 0, 3, 1, 4)
    keep = ~pad[:, None, None, :] & torch.ones(L, L, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    ref = attn.proj(ref.transpose(1, 2).reshape(2, L, 24))
real = ~pad
print(f"blockwise causal attention vs SDPA causal + padding, real tokens: max abs diff "
      f"{(y - ref)[real].abs().max().item():.6f}")
