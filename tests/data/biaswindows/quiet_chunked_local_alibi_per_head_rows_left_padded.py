"""Correct: a chunked local attention over a left-padded batch, its scores laid (B * H, chunks, chunk, 2 * chunk) with
4 heads and 4 chunks (heads == windows, as in the bug), its ALiBi bias made per (batch row, head) and laid
(B * H, 1, chunk, 2 * chunk), so every chunk of a head gets that head's slope; masked with masked_fill(finfo.min)
(causal, the left padding, the missing chunk before the first). Must stay quiet."""
import torch
from torch import nn


class ChunkedAlibiAttention(nn.Module):
    def __init__(self, dim=32, n_heads=4, chunk=6):
        super().__init__()
        self.n_heads, self.chunk = n_heads, chunk
        self.head_dim = dim // n_heads
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8 * (i + 1) / n_heads) for i in range(n_heads)]))

    def forward(self, x, real):
        b, t, _ = x.shape
        h, c = self.n_heads, self.chunk
        n = t // c
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (y.view(b, t, h, -1).transpose(1, 2).reshape(b * h, n, c, -1) for y in (q, k, v))
        pad = torch.zeros_like(k[:, :1])
        k2 = torch.cat([torch.cat([pad, k[:, :-1]], 1), k], 2)
        v2 = torch.cat([torch.cat([pad, v[:, :-1]], 1), v], 2)
        sim = torch.einsum("bnid,bnjd->bnij", q, k2) * self.head_dim ** -0.5
        distance = (torch.arange(c, 2 * c)[:, None] - torch.arange(2 * c)[None, :]).abs().float()  # (c, 2c)
        alibi = -self.slopes.repeat(b)[:, None, None, None] * distance  # (b h, 1, c, 2c)
        sim = sim + alibi
        q_at = (torch.arange(n)[:, None] * c + torch.arange(c))[:, :, None]
        k_at = (torch.arange(n)[:, None] * c - c + torch.arange(2 * c))[:, None, :]
        keep = (k_at <= q_at) & (k_at >= 0)
        real_keys = torch.cat([torch.zeros(b, c, dtype=torch.bool), real], 1).unfold(1, 2 * c, c)[:, :n]
        keep = (keep[None] & real_keys[:, :, None, :]) | (k_at == q_at)[None]
        keep = keep.repeat_interleave(h, dim=0)
        sim = sim.masked_fill(~keep, torch.finfo(sim.dtype).min)
        out = torch.einsum("bnij,bnjd->bnid", sim.softmax(-1), v2)
        out = out.reshape(b, h, t, -1).transpose(1, 2).reshape(b, t, -1)
        return x + self.to_out(out)


def main():
    torch.manual_seed(0)
    lengths = torch.tensor([24, 17])
    real = torch.arange(24)[None, :] >= (24 - lengths)[:, None]
    with torch.no_grad():
        out = ChunkedAlibiAttention()(torch.randn(2, 24, 32), real)
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
