"""mlx-audio Voxtral TTS audio tokenizer (codec decoder): ALiBi distance reversed, no sliding window.

Citation: Blaizzy/mlx-audio commit 0570bb1b ("Fix vocoder ALiBi sign, sliding window, and codebook
precision"), mlx_audio/tts/models/voxtral_tts/audio_tokenizer.py (Attention.__call__,
TransformerLayer / TransformerBlock, VoxtralTTSAudioTokenizer.decode).

The bug: Attention built the ALiBi distance as ``positions[None, :] - positions[:, None]`` (j - i)
and added only ``triu(full(-1e9), k=1)``: every decoder transformer stage attended all past frames
although the checkpoint's config has ``attn_sliding_window_size = 16`` halved per downsampling
(the decoder stages use windows 2, 4, 8, 16), and the ALiBi term had the wrong sign.

The fix: ``dist = positions[:, None] - positions[None, :]`` (i - j), a window mask
``where(dist > window_size, -1e9, 0)`` added to the causal mask, and decode() passes
``window_sizes = [2, 4, 8, 16]`` per stage down through TransformerBlock / TransformerLayer.

The MLX code is rendered in torch (channels-last (B, T, C) kept, mx.conv_transpose1d trimmed to
T * stride, weight-normed causal convs), at toy sizes with random weights: dim 32, 4 heads of 8,
one layer per stage, a 64-entry single codebook in place of the semantic + acoustic quantizer,
patch size 8, 12 code frames. The codebook float32 change of the same commit is not shown.
"""

import math
import sys
from dataclasses import dataclass
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class AudioTokenizerArgs:
    pretransform_patch_size: int = 8  # 240
    patch_proj_kernel_size: int = 7
    codebook_size: int = 64
    codebook_dim: int = 24  # semantic_dim + acoustic_dim = 292
    causal: bool = True
    attn_sliding_window_size: int = 16
    half_attn_window_upon_downsampling: bool = True
    dim: int = 32  # 1024
    hidden_dim: int = 64  # 4096
    head_dim: int = 8  # 128
    n_heads: int = 4  # 8
    n_kv_heads: int = 4
    qk_norm_eps: float = 1e-06
    qk_norm: bool = True
    norm_eps: float = 0.01
    layer_scale: bool = True
    layer_scale_init: float = 0.5  # 0.01 in the checkpoint; larger so the toy attention shows
    decoder_transformer_lengths_str: str = "1,1,1,1"  # "2,2,2,2"
    decoder_convs_kernels_str: str = "3,4,4,4"
    decoder_convs_strides_str: str = "1,2,2,2"

    @property
    def decoder_transformer_lengths(self) -> List[int]:
        return [int(x) for x in self.decoder_transformer_lengths_str.split(",")]

    @property
    def decoder_convs_kernels(self) -> List[int]:
        return [int(x) for x in self.decoder_convs_kernels_str.split(",")]

    @property
    def decoder_convs_strides(self) -> List[int]:
        return [int(x) for x in self.decoder_convs_strides_str.split(",")]


class WeightNormConv(nn.Module):
    """Causal Conv1d with weight normalization (g, v), channels-last input."""

    def __init__(self, out_channels, in_channels, kernel_size):
        super().__init__()
        self.original0 = nn.Parameter(torch.ones(out_channels, 1, 1))
        self.original1 = nn.Parameter(torch.randn(out_channels, in_channels, kernel_size))

    def _get_weight(self):
        g, v = self.original0, self.original1
        v_norm = torch.sqrt((v * v).sum(dim=(1, 2), keepdim=True) + 1e-12)
        return g * v / v_norm

    def forward(self, x, stride=1, transpose=False):
        weight = self._get_weight()
        if transpose:
            return self._conv_transpose_1d(x, weight, stride)
        return self._conv_1d(x, weight, stride)

    def _conv_1d(self, x, weight, stride):
        K = weight.shape[2]
        if K > 1:
            B, T, C = x.shape
            x = torch.cat([x.new_zeros(B, K - 1, C), x], dim=1)
        return F.conv1d(x.transpose(1, 2), weight, stride=stride).transpose(1, 2)

    def _conv_transpose_1d(self, x, weight, stride):
        # checkpoint weight (out_ch, in_ch, K) is ConvTranspose1d's (C_in, C_out, K)
        B, T, C = x.shape
        out = F.conv_transpose1d(x.transpose(1, 2), weight, stride=stride).transpose(1, 2)
        return out[:, : T * stride, :]


class ConvBlock(nn.Module):
    def __init__(self, out_channels, in_channels, kernel_size):
        super().__init__()
        self.conv = WeightNormConv(out_channels, in_channels, kernel_size)


def _get_alibi_slopes(n_heads):
    def _get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * (start**i) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = _get_slopes_power_of_2(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = _get_slopes_power_of_2(closest)
        extra = _get_slopes_power_of_2(2 * closest)
        slopes += extra[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(args.n_heads * args.head_dim, eps=args.qk_norm_eps)
        self.k_norm = nn.RMSNorm(args.n_kv_heads * args.head_dim, eps=args.qk_norm_eps)

    def forward(self, x, alibi_slopes, window_size=0):
        B, T, _ = x.shape
        q = self.q_norm(self.wq(x))
        k = self.k_norm(self.wk(x))
        v = self.wv(x)
        q = q.reshape(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) * self.scale

        # ALiBi bias
        positions = torch.arange(T)
        if FIXED:
            dist = positions[:, None] - positions[None, :]
        else:
            dist = positions[None, :] - positions[:, None]
        alibi = alibi_slopes[:, None, None] * dist[None, :, :].float()

        # Causal mask (+ sliding window after the fix)
        causal_mask = torch.triu(torch.full((T, T), -1e9), diagonal=1)
        if FIXED and window_size > 0:
            # Mask positions too far in the past (i - j > window_size)
            window_mask = torch.where(dist > window_size, -1e9, 0.0)
            causal_mask = causal_mask + window_mask
        scores = scores + alibi + causal_mask[None, None, :, :]

        weights = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        out = (weights @ v).transpose(1, 2).reshape(B, T, -1)
        return self.wo(out)


class TransformerLayer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.feed_forward = nn.Sequential(
            nn.Linear(args.dim, args.hidden_dim, bias=False), nn.SiLU(), nn.Linear(args.hidden_dim, args.dim, bias=False)
        )
        self.attention_scale = nn.Parameter(torch.full((args.dim,), args.layer_scale_init))
        self.ffn_scale = nn.Parameter(torch.full((args.dim,), args.layer_scale_init))

    def forward(self, x, alibi_slopes, window_size=0):
        if FIXED:
            h = self.attention(self.attention_norm(x), alibi_slopes, window_size=window_size)
        else:
            h = self.attention(self.attention_norm(x), alibi_slopes)
        x = x + h * self.attention_scale
        return x + self.feed_forward(self.ffn_norm(x)) * self.ffn_scale


class TransformerBlock(nn.Module):
    def __init__(self, n_layers, args):
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer(args) for _ in range(n_layers)])

    def forward(self, x, alibi_slopes, window_size=0):
        for layer in self.layers:
            if FIXED:
                x = layer(x, alibi_slopes, window_size=window_size)
            else:
                x = layer(x, alibi_slopes)
        return x


class VoxtralTTSAudioTokenizer(nn.Module):
    """decoder_blocks = [conv0, xformer0, conv1, xformer1, ...], then output_proj."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.codebook = nn.Embedding(args.codebook_size, args.codebook_dim)  # stands in for the quantizer
        self.register_buffer("_alibi_slopes", _get_alibi_slopes(args.n_heads), persistent=False)
        strides = args.decoder_convs_strides
        blocks = []
        for i, (stride, kernel, n_layers) in enumerate(
            zip(strides, args.decoder_convs_kernels, args.decoder_transformer_lengths)
        ):
            in_ch = args.codebook_dim if i == 0 else args.dim
            blocks.append(ConvBlock(args.dim, in_ch, kernel))
            blocks.append(TransformerBlock(n_layers, args))
        self.decoder_blocks = nn.ModuleList(blocks)
        self.output_proj = ConvBlock(args.pretransform_patch_size, args.dim, args.patch_proj_kernel_size)
        self._strides = strides

    def decode(self, codes):
        x = self.codebook(codes)  # (B, T, codebook_dim)

        # Sliding window sizes per decoder stage: [2, 4, 8, 16]
        window_sizes = [2, 4, 8, 16]

        for i in range(0, len(self.decoder_blocks), 2):
            conv_block = self.decoder_blocks[i]
            xformer_block = self.decoder_blocks[i + 1]
            stage_idx = i // 2
            stride = self._strides[stage_idx]
            is_transpose = stride > 1
            x = conv_block.conv(x, stride=stride, transpose=is_transpose)
            if FIXED:
                window = window_sizes[stage_idx] if stage_idx < len(window_sizes) else 16
                x = xformer_block(x, self._alibi_slopes, window_size=window)
            else:
                x = xformer_block(x, self._alibi_slopes)

        x = self.output_proj.conv(x, stride=1, transpose=False)  # (B, T_up, patch)
        B = x.shape[0]
        return x.reshape(B, -1)


def main():
    torch.manual_seed(0)
    args = AudioTokenizerArgs()
    model = VoxtralTTSAudioTokenizer(args).eval()
    codes = torch.randint(0, args.codebook_size, (1, 12))
    with torch.no_grad():
        wav = model.decode(codes)
    print("waveform", tuple(wav.shape))
    print("last 8 samples:", [round(s, 4) for s in wav[0, -8:].tolist()])
    print("rms:", round(wav.pow(2).mean().sqrt().item(), 6))


if __name__ == "__main__":
    main()
