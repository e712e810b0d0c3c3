"""WeNet Conv2dSubsampling4: the frame mask is subsampled from the wrong end (wenet#1602).

Citation: wenet-e2e/wenet#1602 ("Fix conv2d subsampling4 mask bug", merged 2022-12). The PR
changes ``x_mask[:, :, :-2:2][:, :, :-2:2]`` to ``x_mask[:, :, 2::2][:, :, 2::2]``; the author
explains that trimming from the tail is wrong in a batch because a shorter utterance's padding
is at its tail ("[:-2:2] 有bug的原因是去除pad是从尾部去除的..."). I read the PR description and
comments, not the diff view; the two lines are quoted there.

Bug: each Conv2d(kernel 3, stride 2) output frame t reads input frames 2t..2t+2, so it is real
only if frame 2t+2 is. Slicing ``[:-2:2]`` keeps input frame 2t's flag for output frame t, so a
padded row keeps up to one extra frame per stage whose receptive field runs into the padding,
and the encoder's self-attention (mask (B, 1, T') from the subsampling layer) treats those
frames as real keys.

Fix: take the flags from ``[2::2]`` at both stages (the last input frame each output reads).

Reproduction: a WeNet-style TransformerEncoder (config as the dict WeNet reads from its yaml
``encoder_conf``), fbank-like features of lengths 20 and 13 padded to 20, mask
``~make_pad_mask(xs_lens, T).unsqueeze(1)`` as WeNet builds it. The conv stack gives 4 frames;
the 13-frame row has 2 real frames, the buggy slice keeps all 4.
"""
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv

encoder_conf = {
    "output_size": 32,
    "attention_heads": 4,
    "linear_units": 64,
    "num_blocks": 2,
    "dropout_rate": 0.0,
    "positional_dropout_rate": 0.0,
    "attention_dropout_rate": 0.0,
    "input_layer": "conv2d",
    "normalize_before": True,
}


def make_pad_mask(lengths: torch.Tensor, max_len: int = 0) -> torch.Tensor:
    batch_size = lengths.size(0)
    max_len = max_len if max_len > 0 else lengths.max().item()
    seq_range = torch.arange(0, max_len, dtype=torch.int64, device=lengths.device)
    seq_range_expand = seq_range.unsqueeze(0).expand(batch_size, max_len)
    seq_length_expand = lengths.unsqueeze(-1)
    mask = seq_range_expand >= seq_length_expand
    return mask


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, dropout_rate: float, max_len: int = 5000):
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(self.d_model)
        self.dropout = nn.Dropout(p=dropout_rate)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x, offset=0):
        pos_emb = self.pe[:, offset:offset + x.size(1)]
        x = x * self.xscale + pos_emb
        return self.dropout(x), self.dropout(pos_emb)


class Conv2dSubsampling4(nn.Module):
    """Convolutional 2D subsampling (to 1/4 length)."""

    def __init__(self, idim: int, odim: int, dropout_rate: float, pos_enc_class: nn.Module):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, odim, 3, 2),
            nn.ReLU(),
            nn.Conv2d(odim, odim, 3, 2),
            nn.ReLU(),
        )
        self.out = nn.Sequential(nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim))
        self.pos_enc = pos_enc_class
        # The right context for every conv layer is computed by:
        # (kernel_size - 1) * frame_rate_of_this_layer
        self.subsampling_rate = 4
        self.right_context = 6

    def forward(self, x, x_mask, offset=0):
        x = x.unsqueeze(1)  # (b, c=1, t, f)
        x = self.conv(x)
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).contiguous().view(b, t, c * f))
        x, pos_emb = self.pos_enc(x, offset)
        if FIXED:
            return x, pos_emb, x_mask[:, :, 2::2][:, :, 2::2]
        return x, pos_emb, x_mask[:, :, :-2:2][:, :, :-2:2]


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head: int, n_feat: int, dropout_rate: float):
        super().__init__()
        assert n_feat % n_head == 0
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask.size(2) > 0:  # time2 > 0
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            mask = mask[:, :, :, : scores.size(-1)]
            scores = scores.masked_fill(mask, -float("inf"))
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)  # (batch, head, time1, time2)
        else:
            attn = torch.softmax(scores, dim=-1)
        p_attn = self.dropout(attn)
        x = torch.matmul(p_attn, value)  # (batch, head, time1, d_k)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask=torch.ones((0, 0, 0), dtype=torch.bool)):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, size, self_attn, feed_forward, dropout_rate, normalize_before=True):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(size, eps=1e-5)
        self.norm2 = nn.LayerNorm(size, eps=1e-5)
        self.dropout = nn.Dropout(dropout_rate)
        self.normalize_before = normalize_before

    def forward(self, x, mask, pos_emb, mask_pad):
        residual = x
        if self.normalize_before:
            x = self.norm1(x)
        x = residual + self.dropout(self.self_attn(x, x, x, mask))
        residual = x
        if self.normalize_before:
            x = self.norm2(x)
        x = residual + self.dropout(self.feed_forward(x))
        return x, mask


class TransformerEncoder(nn.Module):
    def __init__(self, input_size, output_size=256, attention_heads=4, linear_units=2048, num_blocks=6,
                 dropout_rate=0.1, positional_dropout_rate=0.1, attention_dropout_rate=0.0,
                 input_layer="conv2d", normalize_before=True):
        super().__init__()
        assert input_layer == "conv2d"
        self.embed = Conv2dSubsampling4(input_size, output_size, dropout_rate,
                                        PositionalEncoding(output_size, positional_dropout_rate))
        self.normalize_before = normalize_before
        self.after_norm = nn.LayerNorm(output_size, eps=1e-5)
        self.encoders = nn.ModuleList([
            TransformerEncoderLayer(
                output_size,
                MultiHeadedAttention(attention_heads, output_size, attention_dropout_rate),
                nn.Sequential(nn.Linear(output_size, linear_units), nn.ReLU(), nn.Linear(linear_units, output_size)),
                dropout_rate, normalize_before)
            for _ in range(num_blocks)
        ])

    def forward(self, xs, xs_lens, decoding_chunk_size=0, num_decoding_left_chunks=-1):
        T = xs.size(1)
        masks = ~make_pad_mask(xs_lens, T).unsqueeze(1)  # (B, 1, T)
        xs, pos_emb, masks = self.embed(xs, masks)
        mask_pad = masks  # (B, 1, T/subsample_rate)
        chunk_masks = masks  # full-context training: add_optional_chunk_mask returns masks unchanged
        for layer in self.encoders:
            xs, chunk_masks = layer(xs, chunk_masks, pos_emb, mask_pad)
        if self.normalize_before:
            xs = self.after_norm(xs)
        return xs, masks


def main():
    torch.manual_seed(0)
    encoder = TransformerEncoder(input_size=16, **encoder_conf).eval()
    feats = torch.randn(2, 20, 16)
    feats_lengths = torch.tensor([20, 13])
    feats[1, 13:] = 0.0
    with torch.no_grad():
        encoder_out, encoder_mask = encoder(feats, feats_lengths)
    print("encoder_out", tuple(encoder_out.shape), "encoder_out_lens", encoder_mask.squeeze(1).sum(1).tolist())


if __name__ == "__main__":
    main()
