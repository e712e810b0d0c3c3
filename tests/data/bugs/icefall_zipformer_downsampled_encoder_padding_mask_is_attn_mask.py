"""icefall Zipformer: DownsampledZipformerEncoder hands its attention mask as the key padding mask.

Citation: k2-fsa/icefall#767 (issue "confusion about masks used in zipformer"), fixed by
k2-fsa/icefall#768 ("Minor fix in zipformer.py: Fix src_key_padding_mask in DownsampledZipformerEncoder").

Bug: in egs/librispeech/ASR/pruned_transducer_stateless7/zipformer.py,
DownsampledZipformerEncoder.forward called
``self.encoder(src, feature_mask=feature_mask, mask=mask, src_key_padding_mask=mask)``.
In training / non-streaming decoding ``mask`` (the (S, S) attention mask) is None, so the
downsampled stacks ran with no key padding mask and every frame attended the padded frames of
shorter utterances. Only the first, non-downsampled stack masked padding.
Fix: pass ``src_key_padding_mask=src_key_padding_mask`` (the caller already downsampled it).

Reproduction: a two-stack Zipformer (downsampling factors 1 and 2) in the shape of the recipe,
relative-position attention replaced by plain scaled dot-product scores with the same masked_fill
on key_padding_mask, over a batch of utterances of 16 and 10 frames. Run with --fixed for the
code after #768.
"""
import sys
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn
from torch import Tensor

FIXED = "--fixed" in sys.argv


def make_pad_mask(lengths: Tensor, max_len: int = 0) -> Tensor:
    """True at padded frames (icefall.utils.make_pad_mask)."""
    max_len = max(max_len, lengths.max())
    n = lengths.size(0)
    seq_range = torch.arange(0, max_len, device=lengths.device)
    expaned_lengths = seq_range.unsqueeze(0).expand(n, max_len)
    return expaned_lengths >= lengths.unsqueeze(-1)


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor, attn_mask: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None) -> Tensor:
        seq_len, bsz, _ = x.shape
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        q = q.reshape(seq_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.reshape(seq_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.reshape(seq_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_output_weights = torch.bmm(q, k.transpose(1, 2)) * self.head_dim ** -0.5
        if attn_mask is not None:
            attn_output_weights = attn_output_weights.masked_fill(attn_mask.unsqueeze(0), float("-inf"))
        if key_padding_mask is not None:
            attn_output_weights = attn_output_weights.view(bsz, self.num_heads, seq_len, seq_len)
            attn_output_weights = attn_output_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2), float("-inf"))
            attn_output_weights = attn_output_weights.view(bsz * self.num_heads, seq_len, seq_len)
        attn_output_weights = attn_output_weights.softmax(dim=-1)
        out = torch.bmm(attn_output_weights, v)
        out = out.transpose(0, 1).reshape(seq_len, bsz, self.embed_dim)
        return self.out_proj(out)


class ZipformerEncoderLayer(nn.Module):
    def __init__(self, d_model: int, nhead: int, feedforward_dim: int):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead)
        self.feed_forward = nn.Sequential(nn.Linear(d_model, feedforward_dim), nn.SiLU(),
                                          nn.Linear(feedforward_dim, d_model))
        self.norm_final = nn.LayerNorm(d_model)

    def forward(self, src: Tensor, src_mask: Optional[Tensor] = None,
                src_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        src = src + self.self_attn(src, attn_mask=src_mask, key_padding_mask=src_key_padding_mask)
        src = src + self.feed_forward(src)
        return self.norm_final(src)


class ZipformerEncoder(nn.Module):
    def __init__(self, encoder_layer_args, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList([ZipformerEncoderLayer(*encoder_layer_args) for _ in range(num_layers)])

    def forward(self, src: Tensor, feature_mask: Union[Tensor, float] = 1.0,
                mask: Optional[Tensor] = None,
                src_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        output = src * feature_mask
        for mod in self.layers:
            output = mod(output, src_mask=mask, src_key_padding_mask=src_key_padding_mask)
            output = output * feature_mask
        return output


class AttentionDownsample(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, downsample: int):
        super().__init__()
        self.query = nn.Parameter(torch.randn(in_channels) * (in_channels ** -0.5))
        self.extra_proj = nn.Linear(in_channels * downsample, out_channels - in_channels, bias=False) \
            if out_channels > in_channels else None
        self.downsample = downsample

    def forward(self, src: Tensor) -> Tensor:
        (seq_len, batch_size, in_channels) = src.shape
        ds = self.downsample
        d_seq_len = (seq_len + ds - 1) // ds
        if seq_len != d_seq_len * ds:
            pad = d_seq_len * ds - seq_len
            src_extra = src[src.shape[0] - 1:].expand(pad, src.shape[1], src.shape[2])
            src = torch.cat((src, src_extra), dim=0)
        src = src.reshape(d_seq_len, ds, batch_size, in_channels)
        weights = (src * self.query).sum(dim=-1, keepdim=True).softmax(dim=1)
        ans = (src * weights).sum(dim=1)
        src = src.permute(0, 2, 1, 3).reshape(d_seq_len, batch_size, ds * in_channels)
        if self.extra_proj is not None:
            ans = torch.cat((ans, self.extra_proj(src)), dim=2)
        return ans


class SimpleUpsample(nn.Module):
    def __init__(self, num_channels: int, upsample: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(upsample, num_channels) * 0.01)

    def forward(self, src: Tensor) -> Tensor:
        upsample = self.bias.shape[0]
        (seq_len, batch_size, num_channels) = src.shape
        src = src.unsqueeze(1).expand(seq_len, upsample, batch_size, num_channels)
        src = src + self.bias.unsqueeze(1)
        return src.reshape(seq_len * upsample, batch_size, num_channels)


class DownsampledZipformerEncoder(nn.Module):
    def __init__(self, encoder: nn.Module, input_dim: int, output_dim: int, downsample: int):
        super().__init__()
        self.downsample_factor = downsample
        self.downsample = AttentionDownsample(input_dim, output_dim, downsample)
        self.encoder = encoder
        self.upsample = SimpleUpsample(output_dim, downsample)

    def forward(self, src: Tensor, feature_mask: Union[Tensor, float] = 1.0,
                mask: Optional[Tensor] = None,
                src_key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """src_key_padding_mask: (N, S), should be downsampled already."""
        src_orig = src
        src = self.downsample(src)
        ds = self.downsample_factor
        if mask is not None:
            mask = mask[::ds, ::ds]
        if FIXED:
            src = self.encoder(src, feature_mask=feature_mask, mask=mask,
                               src_key_padding_mask=src_key_padding_mask)
        else:
            src = self.encoder(src, feature_mask=feature_mask, mask=mask, src_key_padding_mask=mask)
        src = self.upsample(src)
        src = src[:src_orig.shape[0]]
        return src_orig + src[..., :src_orig.shape[-1]]


class Zipformer(nn.Module):
    def __init__(self, num_features: int = 20, encoder_dims: Tuple[int, int] = (32, 32),
                 nhead: Tuple[int, int] = (4, 4), feedforward_dim: Tuple[int, int] = (64, 64),
                 num_encoder_layers: Tuple[int, int] = (1, 1),
                 zipformer_downsampling_factors: Tuple[int, int] = (1, 2)):
        super().__init__()
        self.zipformer_downsampling_factors = zipformer_downsampling_factors
        self.encoder_embed = nn.Linear(num_features, encoder_dims[0])
        encoders = []
        for i in range(len(encoder_dims)):
            encoder = ZipformerEncoder((encoder_dims[i], nhead[i], feedforward_dim[i]), num_encoder_layers[i])
            if zipformer_downsampling_factors[i] != 1:
                encoder = DownsampledZipformerEncoder(encoder, input_dim=encoder_dims[i - 1],
                                                      output_dim=encoder_dims[i],
                                                      downsample=zipformer_downsampling_factors[i])
            encoders.append(encoder)
        self.encoders = nn.ModuleList(encoders)

    def forward(self, x: Tensor, x_lens: Tensor) -> Tuple[Tensor, Tensor]:
        x = self.encoder_embed(x)
        x = x.permute(1, 0, 2)  # (N, T, C) -> (T, N, C)
        src_key_padding_mask = make_pad_mask(x_lens)
        for i, module in enumerate(self.encoders):
            ds = self.zipformer_downsampling_factors[i]
            x = module(x, feature_mask=1.0,
                       src_key_padding_mask=(None if src_key_padding_mask is None
                                             else src_key_padding_mask[..., ::ds]))
        x = x.permute(1, 0, 2)
        return x, x_lens


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Zipformer().eval()
    x = torch.randn(2, 16, 20)
    x_lens = torch.tensor([16, 10])
    x[1, 10:] = 0.0  # feature padding of the shorter utterance
    with torch.no_grad():
        out, out_lens = model(x, x_lens)
    print("encoder_out", tuple(out.shape), "utt1 frame0", [round(v, 4) for v in out[1, 0, :4].tolist()])
