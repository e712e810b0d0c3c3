"""Explicit Sparse Transformer's top-k attention (Zhao et al. 2019, lancopku/Explicit-Sparse-Transformer: `vk, _ =
torch.topk(attn, k)`, `mask_k = torch.lt(attn, tk)`, `attn.masked_fill(mask_k, -1e18)`) in an encoder over a
right-padded batch, written so that the top-k is taken before the key padding mask is filled in: the padded keys of
row 1 take some of each query's k slots, and are then masked, so those queries keep fewer than k keys. --fixed fills
the padding first and ranks the real keys only.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class SparseSelfAttention(nn.Module):
    def __init__(self, d_model=32, heads=2, top_k=3):
        super().__init__()
        self.heads = heads
        self.top_k = top_k
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)

    def forward(self, x, src_mask):
        """x (B, L, D); src_mask (B, 1, 1, L), 1 at a real key."""
        b, n, d = x.shape
        split = lambda t: t.view(b, n, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = split(self.w_q(x)), split(self.w_k(x)), split(self.w_v(x))
        attn = torch.matmul(q, k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        if FIXED:
            attn = attn.masked_fill(src_mask == 0, -1e18)
        vk, _ = torch.topk(attn, self.top_k)
        tk = vk[:, :, :, -1].unsqueeze(3).expand_as(attn)
        mask_k = torch.lt(attn, tk)
        attn = attn.masked_fill(mask_k, -1e18)
        if not FIXED:
            attn = attn.masked_fill(src_mask == 0, -1e18)
        p = torch.softmax(attn, dim=-1)
        return torch.matmul(p, v).transpose(1, 2).reshape(b, n, d), p


def weights():
    """The softmax weights (B, H, L, L) of the layer over the padded batch."""
    torch.manual_seed(1)
    lengths = torch.tensor([8, 5])
    src_mask = (torch.arange(8)[None, :] < lengths[:, None])[:, None, None, :].long()
    x = torch.randn(2, 8, 32)
    layer = SparseSelfAttention().eval()
    with torch.no_grad():
        _, p = layer(x, src_mask)
    return p


def main():
    p = weights()
    kept = (p[1] > 0).sum(-1)
    print(f"fewest keys a query of row 1 keeps (top-k 3): {kept.min().item()}")


if __name__ == "__main__":
    main()
