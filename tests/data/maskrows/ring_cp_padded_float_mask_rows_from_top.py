"""A context-parallel attention written another way (a Megatron-style float additive mask, a left-padded batch of
two, two ranks, a shard's queries over all-gathered keys): each rank must add the rows of the (B, 1, L, L) mask that
belong to its own queries. The bug: `attention_mask[..., :sq, :]` on every rank (the top rows); the fix: the rank's
own rows `attention_mask[..., rank * sq:(rank + 1) * sq, :]`."""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

CP, L, H, D = 2, 12, 2, 8


def build_mask(lengths: list[int], seq_len: int) -> torch.Tensor:
    """(B, 1, L, L) float: 0 where a query may attend (causal, real keys of a left-padded row), the dtype's min else."""
    i = torch.arange(seq_len)
    causal = i[None, :] <= i[:, None]
    real = torch.stack([i >= seq_len - n for n in lengths])  # (B, L): left padding
    keep = causal[None] & real[:, None, :]
    keep = keep | torch.eye(seq_len, dtype=torch.bool)[None]  # (a padding query sees itself: no empty row)
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)[:, None]


class RankAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = torch.nn.Linear(H * D, H * D)
        self.wkv = torch.nn.Linear(H * D, 2 * H * D)

    def forward(self, x_local, x_all, attention_mask, rank):
        b, sq, _ = x_local.shape
        q = self.wq(x_local).view(b, sq, H, D).transpose(1, 2)
        k, v = self.wkv(x_all).view(b, -1, 2, H, D).permute(2, 0, 3, 1, 4)
        if FIXED:
            bias = attention_mask[..., rank * sq:(rank + 1) * sq, :]
        else:
            bias = attention_mask[..., :sq, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, sq, H * D)


def main():
    layer = RankAttention().eval()
    x = torch.randn(2, L, H * D)
    mask = build_mask([12, 7], L)
    sq = L // CP
    with torch.no_grad():
        out = torch.cat([layer(x[:, r * sq:(r + 1) * sq], x, mask, r) for r in range(CP)], dim=1)
        q = layer.wq(x).view(2, L, H, D).transpose(1, 2)
        k, v = layer.wkv(x).view(2, L, 2, H, D).permute(2, 0, 3, 1, 4)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(2, L, H * D)
    print(f"{'fixed' if FIXED else 'buggy'}: max |sharded - whole| = {(out - ref).abs().max():.4e}")


if __name__ == "__main__":
    main()
