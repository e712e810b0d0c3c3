# hirofumi0810/neural_sp#121 (commit d7811fc2): the latency-controlled ('mask') Transformer encoder let every layer
# attend N_r right-context frames, so lookahead grew with depth; after the fix only the first layer sees N_r.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
NEG_INF = float(torch.finfo(torch.float32).min)


def make_pad_mask(seq_lens):
    bs, max_time = seq_lens.size(0), seq_lens.max().item()
    seq_range = torch.arange(0, max_time, dtype=torch.int64).unsqueeze(0).expand(bs, max_time)
    return seq_range < seq_lens.unsqueeze(-1)


class MultiheadAttentionMechanism(nn.Module):
    def __init__(self, kdim, qdim, adim, odim, n_heads):
        super().__init__()
        self.d_k = adim // n_heads
        self.n_heads = n_heads
        self.scale = math.sqrt(self.d_k)
        self.w_key = nn.Linear(kdim, adim)
        self.w_value = nn.Linear(kdim, adim)
        self.w_query = nn.Linear(qdim, adim)
        self.w_out = nn.Linear(adim, odim)

    def forward(self, key, value, query, mask):
        bs, klen, qlen = key.size(0), key.size(1), query.size(1)
        k = self.w_key(key).view(bs, -1, self.n_heads, self.d_k).transpose(2, 1)
        v = self.w_value(value).view(bs, -1, self.n_heads, self.d_k).transpose(2, 1)
        q = self.w_query(query).view(bs, -1, self.n_heads, self.d_k).transpose(2, 1)
        e = torch.matmul(q, k.transpose(3, 2)) / self.scale  # `[B, H, qlen, klen]`
        if mask is not None:
            mask = mask.unsqueeze(1).repeat([1, self.n_heads, 1, 1])
            e = e.masked_fill_(mask == 0, NEG_INF)
        aw = torch.softmax(e, dim=-1)
        cv = torch.matmul(aw, v).transpose(2, 1).contiguous().view(bs, -1, self.n_heads * self.d_k)
        return self.w_out(cv), aw


class TransformerEncoderBlock(nn.Module):
    def __init__(self, d_model, d_ff, n_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = MultiheadAttentionMechanism(d_model, d_model, d_model, d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.feed_forward = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model))

    def forward(self, xs, xx_mask=None):
        residual = xs
        xs = self.norm1(xs)
        xs, _ = self.self_attn(xs, xs, xs, mask=xx_mask)
        xs = xs + residual
        return self.feed_forward(self.norm2(xs)) + xs


class TransformerEncoder(nn.Module):
    def __init__(self, input_dim=8, d_model=16, n_layers=3, n_heads=2,
                 chunk_size_left=4, chunk_size_current=4, chunk_size_right=2, streaming_type='mask'):
        super().__init__()
        self.chunk_size_left = chunk_size_left
        self.chunk_size_current = chunk_size_current
        self.chunk_size_right = chunk_size_right
        self.streaming_type = streaming_type
        self.embed = nn.Linear(input_dim, d_model)
        self.layers = nn.ModuleList([TransformerEncoderBlock(d_model, 32, n_heads) for _ in range(n_layers)])
        self.norm_out = nn.LayerNorm(d_model)

    def forward(self, xs, xlens):
        N_l, N_c, N_r = self.chunk_size_left, self.chunk_size_current, self.chunk_size_right
        n_chunks = math.ceil(xs.size(1) / N_c)
        xs = self.embed(xs)
        xx_mask = make_pad_mask(xlens)
        xx_mask = xx_mask.unsqueeze(1).repeat([1, xs.size(1), 1])  # `[B, emax (query), emax (key)]`
        if FIXED:
            xx_mask_first = xx_mask.clone()
            for chunk_idx in range(n_chunks):
                offset = chunk_idx * N_c
                # for first layer
                xx_mask_first[:, offset:offset + N_c, :max(0, offset - N_l)] = 0
                xx_mask_first[:, offset:offset + N_c, offset + (N_c + N_r):] = 0
                # for upper layers
                xx_mask[:, offset:offset + N_c, :max(0, offset - N_l)] = 0
                xx_mask[:, offset:offset + N_c, offset + N_c:] = 0
        else:
            for chunk_idx in range(n_chunks):
                offset = chunk_idx * N_c
                xx_mask[:, offset:offset + N_c, :max(0, offset - N_l)] = 0
                xx_mask[:, offset:offset + N_c, offset + (N_c + N_r):] = 0
            xx_mask_first = xx_mask
        for lth, layer in enumerate(self.layers):
            xs = layer(xs, xx_mask if lth >= 1 else xx_mask_first)
        return self.norm_out(xs), xlens


def main():
    torch.manual_seed(0)
    enc = TransformerEncoder().eval()
    xs = torch.randn(2, 16, 8)
    xlens = torch.tensor([16, 13])
    xs[1, 13:] = 0.0
    # chunk 0 covers frames 0..3 with N_r=2 lookahead: frames >= 6 must never reach it
    xs_future = xs.clone()
    xs_future[:, 6:13] = torch.randn(2, 7, 8)
    with torch.no_grad():
        out, _ = enc(xs, xlens)
        out_future, _ = enc(xs_future, xlens)
    print("max change of chunk-0 outputs when frames beyond the lookahead change:",
          (out[:, :4] - out_future[:, :4]).abs().max().item())


if __name__ == "__main__":
    main()
