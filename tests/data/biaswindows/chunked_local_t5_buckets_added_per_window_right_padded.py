"""A chunked local-attention encoder-decoder block written another way: T5-style relative buckets (an nn.Embedding of
num_buckets x num_heads, read (Lq, Lk, H) and permuted to (H, Lq, Lk)) added in place (`scores += bias`) to scores
laid (B * H, chunks, chunk, 2 * chunk) by torch.matmul over a right-padded batch; the keys of each chunk are the
previous chunk and its own, masked additively (0 / -inf: causal, the padding, the missing chunk before the first).
With 4 heads and 32 tokens in chunks of 8 there are 4 chunks, so the bias's head axis broadcasts onto the chunks:
chunk c of every head gets head c's buckets (the bug). `--fixed`: the bias repeated per (batch row, head), laid
(B * H, 1, chunk, 2 * chunk)."""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def buckets(relative: torch.Tensor, num_buckets: int = 8, max_distance: int = 16) -> torch.Tensor:
    """T5's causal buckets of k - q (only the past is told apart)."""
    n = (-relative).clamp(min=0)
    exact = num_buckets // 2
    large = exact + (torch.log(n.float() / exact + 1e-6) / torch.log(torch.tensor(max_distance / exact))
                     * (num_buckets - exact)).long()
    return torch.where(n < exact, n, large.clamp(max=num_buckets - 1))


class ChunkedLocalSelfAttention(nn.Module):
    def __init__(self, d_model=32, num_heads=4, chunk=8):
        super().__init__()
        self.num_heads, self.chunk = num_heads, chunk
        self.head_dim = d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.relative_attention_bias = nn.Embedding(8, num_heads)

    def position_bias(self) -> torch.Tensor:
        c = self.chunk
        q_pos = torch.arange(c, 2 * c)[:, None]  # the chunk's queries sit after the previous chunk's keys
        k_pos = torch.arange(2 * c)[None, :]
        values = self.relative_attention_bias(buckets(k_pos - q_pos))  # (c, 2c, H)
        return values.permute(2, 0, 1)  # (H, c, 2c)

    def forward(self, hidden, lengths):
        b, t, _ = hidden.shape
        h, c = self.num_heads, self.chunk
        n = t // c
        q, k, v = self.qkv(hidden).view(b, t, 3, h, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = (x.reshape(b * h, n, c, self.head_dim) for x in (q, k, v))  # (b h) n c d
        k2 = torch.cat([torch.cat([torch.zeros_like(k[:, :1]), k[:, :-1]], 1), k], 2)  # previous chunk and own
        v2 = torch.cat([torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], 1), v], 2)
        scores = torch.matmul(q, k2.transpose(-1, -2)) / self.head_dim ** 0.5  # (b h, n, c, 2c)
        bias = self.position_bias()
        if FIXED:
            bias = bias[None].expand(b, -1, -1, -1).reshape(b * h, 1, c, 2 * c)
        scores += bias
        q_at = (torch.arange(n)[:, None] * c + torch.arange(c)[None, :])[:, :, None]  # (n, c, 1)
        k_at = (torch.arange(n)[:, None] * c - c + torch.arange(2 * c)[None, :])[:, None, :]  # (n, 1, 2c)
        keep = (k_at <= q_at) & (k_at >= 0)
        real = (torch.arange(t)[None, :] < lengths[:, None])  # (b, t): right padding
        real_keys = torch.cat([torch.zeros(b, c, dtype=torch.bool), real], 1)  # (b, c + t): the chunk before the first
        window_keys = real_keys.unfold(1, 2 * c, c)[:, :n]  # (b, n, 2c)
        keep = keep[None] & window_keys[:, :, None, :]
        keep = keep | (k_at == q_at)[None]  # (each query its own key: no empty rows at the pads)
        additive = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
        additive = additive.repeat_interleave(h, dim=0)  # (b h, n, c, 2c)
        weights = torch.softmax(scores + additive, dim=-1)
        out = torch.matmul(weights, v2).reshape(b, h, t, self.head_dim).transpose(1, 2).reshape(b, t, -1)
        return hidden + self.o(out)


def main():
    torch.manual_seed(0)
    layer = ChunkedLocalSelfAttention()
    with torch.no_grad():
        out = layer(torch.randn(2, 32, 32), torch.tensor([32, 27]))
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
