"""ESPnet Conv2dSubsampling shrinks the pad mask by slicing the padded batch, not per utterance.

Citation: espnet/espnet PR #6633 ("Derive Conv*Subsampling masks from per-utterance lengths",
merged; filed as #6600 after #6599). The same slicing was questioned earlier in espnet/espnet#3037.
Written from the PR description; the module layout follows the long-standing ESPnet code
(espnet/nets/pytorch_backend/transformer/subsampling.py, attention.py, espnet2 TransformerEncoder).

Bug: ``Conv2dSubsampling.forward`` returned ``x_mask[:, :, :-2:2][:, :, :-2:2]``. Slicing the
padded mask keeps every other *input* frame, so a shorter utterance keeps ceil(L/2) frames per
layer while its convolution output only has (L - 1) // 2 valid frames. The extra frames are
convolutions over zero padding, and the encoder's self-attention lets every query attend to
them; the utterance's encoding depends on the longest row in the batch.

Fix: rebuild the mask from each row's own length with the convolution length formula
(``_subsample_mask``: lengths = (lengths - kernel) // stride + 1 per conv, then
make_non_pad_mask).

This program: a batch of fbank features with lengths [40, 29] (idim 20) through
Conv2dSubsampling (4x) and one ESPnet MultiHeadedAttention encoder layer. Row 1 has 6 valid
output frames; the sliced mask marks 8 valid.
"""
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def make_pad_mask(lengths, maxlen=None):
    maxlen = int(max(lengths)) if maxlen is None else maxlen
    seq_range = torch.arange(maxlen)
    return seq_range[None, :] >= torch.as_tensor(lengths)[:, None]


def make_non_pad_mask(lengths, maxlen=None):
    return ~make_pad_mask(lengths, maxlen)


def _subsample_mask(x_mask, kernels_strides, out_len):
    """Mask after the convolutions, from each row's own input length."""
    lengths = x_mask.squeeze(1).sum(-1)
    for kernel, stride in kernels_strides:
        lengths = torch.div(lengths - kernel, stride, rounding_mode="floor") + 1
    return make_non_pad_mask(lengths, out_len).unsqueeze(1)


class Conv2dSubsampling(nn.Module):
    """Convolutional 2D subsampling (to 1/4 length)."""

    def __init__(self, idim, odim, dropout_rate):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, odim, 3, 2), nn.ReLU(), nn.Conv2d(odim, odim, 3, 2), nn.ReLU())
        self.out = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)

    def forward(self, x, x_mask):
        x = x.unsqueeze(1)  # (b, c=1, t, f)
        x = self.conv(x)
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).contiguous().view(b, t, c * f))
        if x_mask is None:
            return x, None
        if FIXED:
            return x, _subsample_mask(x_mask, [(3, 2), (3, 2)], t)
        return x, x_mask[:, :, :-2:2][:, :, :-2:2]


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            min_value = torch.finfo(scores.dtype).min
            scores = scores.masked_fill(mask, min_value)
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(attn, value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class TransformerEncoder(nn.Module):
    def __init__(self, input_size, output_size=32, attention_heads=4):
        super().__init__()
        self.embed = Conv2dSubsampling(input_size, output_size, 0.0)
        self.self_attn = MultiHeadedAttention(attention_heads, output_size, 0.0)
        self.norm = nn.LayerNorm(output_size)

    def forward(self, xs_pad, ilens):
        masks = (~make_pad_mask(ilens)[:, None, :]).to(xs_pad.device)
        xs_pad, masks = self.embed(xs_pad, masks)
        xs_pad = xs_pad + self.self_attn(self.norm(xs_pad), self.norm(xs_pad), self.norm(xs_pad), masks)
        olens = masks.squeeze(1).sum(1)
        return xs_pad, olens


def main():
    torch.manual_seed(0)
    feats_lengths = torch.tensor([40, 29])
    feats = torch.randn(2, 40, 20)
    feats[1, 29:] = 0.0  # padding
    encoder = TransformerEncoder(input_size=20).eval()
    with torch.no_grad():
        xs, olens = encoder(feats, feats_lengths)
    print(f"feats_lengths {feats_lengths.tolist()} -> olens {olens.tolist()}")


if __name__ == "__main__":
    main()
