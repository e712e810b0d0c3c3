# hirofumi0810/neural_sp#243 (commit 5195a558, "Fix mask-base streaming Transformer encoder"):
# make_time_restricted_san_mask gave the first layer N_r lookahead frames past the current chunk
# (offset + N_c + N_r), so mask-based training saw the next chunk that chunkwise streaming never has.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
NEG_INF = float(torch.finfo(torch.float32).min)


def make_pad_mask(seq_lens):
    """1 for valid frames, 0 for padding."""
    bs = seq_lens.size(0)
    max_time = seq_lens.max()
    seq_range = torch.arange(0, max_time, dtype=torch.int32)
    return seq_range.unsqueeze(0).expand(bs, max_time) < seq_lens.unsqueeze(-1)


def make_san_mask(xs, xlens):
    xx_mask = make_pad_mask(xlens.to(xs.device))
    return xx_mask.unsqueeze(1).repeat([1, xs.size(1), 1])  # `[B, emax (query), emax (key)]`


def make_time_restricted_san_mask(xs, xlens, N_l, N_c, N_r, n_chunks):
    xx_mask = make_san_mask(xs, xlens)
    xx_mask_first = xx_mask.clone()
    for chunk_idx in range(n_chunks):
        offset = chunk_idx * N_c
        # for first layer
        xx_mask_first[:, offset:offset + N_c, :max(0, offset - N_l)] = 0
        xx_mask_first[:, offset:offset + N_c, offset + (N_c + N_r):] = 0
        # for upper layers
        xx_mask[:, offset:offset + N_c, :max(0, offset - N_l)] = 0
        xx_mask[:, offset:offset + N_c, offset + N_c:] = 0
    return xx_mask_first, xx_mask


def make_chunkwise_san_mask(xs, xlens, N_l, N_c, n_chunks):
    xx_mask = make_san_mask(xs, xlens)
    for chunk_idx in range(n_chunks):
        offset = chunk_idx * N_c
        xx_mask[:, offset:offset + N_c, :max(0, offset - N_l)] = 0
        xx_mask[:, offset:offset + N_c, offset + N_c:] = 0
    return xx_mask


class MultiheadAttentionMechanism(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.d_k = d_model // n_heads
        self.n_heads = n_heads
        self.w_key = nn.Linear(d_model, d_model)
        self.w_value = nn.Linear(d_model, d_model)
        self.w_query = nn.Linear(d_model, d_model)
        self.w_out = nn.Linear(d_model, d_model)

    def forward(self, key, value, query, mask):
        bs, klen, qlen = key.size(0), key.size(1), query.size(1)
        k = self.w_key(key).view(bs, -1, self.n_heads, self.d_k)
        v = self.w_value(value).view(bs, -1, self.n_heads, self.d_k)
        q = self.w_query(query).view(bs, -1, self.n_heads, self.d_k)
        mask = mask.unsqueeze(3).repeat([1, 1, 1, self.n_heads])  # `[B, qlen, klen, H]`
        e = torch.einsum("bihd,bjhd->bijh", (q, k)) / math.sqrt(self.d_k)
        e = e.masked_fill_(mask == 0, NEG_INF)
        aw = torch.softmax(e, dim=2)
        cv = torch.einsum("bijh,bjhd->bihd", (aw, v)).contiguous().view(bs, -1, self.n_heads * self.d_k)
        return self.w_out(cv)


class TransformerEncoderBlock(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = MultiheadAttentionMechanism(d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.feed_forward = nn.Sequential(nn.Linear(d_model, 64), nn.ReLU(), nn.Linear(64, d_model))

    def forward(self, xs, xx_mask):
        xs_norm = self.norm1(xs)
        xs = xs + self.self_attn(xs_norm, xs_norm, xs_norm, mask=xx_mask)
        return xs + self.feed_forward(self.norm2(xs))


class TransformerEncoder(nn.Module):
    def __init__(self, input_dim=16, d_model=32, n_heads=4, n_layers=3,
                 chunk_size_left=8, chunk_size_current=8, chunk_size_right=4):
        super().__init__()
        self.embed = nn.Linear(input_dim, d_model)
        self.layers = nn.ModuleList([TransformerEncoderBlock(d_model, n_heads) for _ in range(n_layers)])
        self.N_l, self.N_c, self.N_r = chunk_size_left, chunk_size_current, chunk_size_right
        self.streaming_type = "mask"

    def forward(self, xs, xlens):
        N_l, N_c, N_r = self.N_l, self.N_c, self.N_r
        xs = self.embed(xs)
        n_chunks = math.ceil(xs.size(1) / N_c)
        if FIXED:
            xx_mask = make_chunkwise_san_mask(xs, xlens, N_l, N_c, n_chunks)
            for layer in self.layers:
                xs = layer(xs, xx_mask)
        else:
            xx_mask_first, xx_mask = make_time_restricted_san_mask(xs, xlens, N_l, N_c, N_r, n_chunks)
            for lth, layer in enumerate(self.layers):
                xs = layer(xs, xx_mask if lth >= 1 else xx_mask_first)
        return xs, xlens


def main():
    torch.manual_seed(0)
    enc = TransformerEncoder()
    xs = torch.randn(2, 32, 16)
    xlens = torch.tensor([32, 27])
    with torch.no_grad():
        out, _ = enc(xs, xlens)  # latency-controlled training forward over the whole utterance
        # streaming inference: when chunk 1 (frames 8..15) is emitted only frames 0..15 exist
        stream, _ = enc(xs[:, :16], torch.tensor([16, 16]))
    diff = (out[:, 8:16] - stream[:, 8:16]).abs().max().item()
    print(f"fixed={FIXED} chunk-1 output, training mask vs chunkwise streaming: max diff {diff:.3e}")


if __name__ == "__main__":
    main()
