"""NeMo Conformer: time-reduction by pooling computes the new lengths as if it pooled log2(factor) times.

Citation: NVIDIA-NeMo/Speech#16224 (issue), fixed by NVIDIA-NeMo/Speech#16226
("fix(asr): SubsamplingReductionModule pooling computes lengths for a single MaxPool1d pass").

Bug: ``SubsamplingReductionModule(reduction='pooling')`` applies one ``MaxPool1d(kernel_size=reduction_factor)``
but computes the output lengths with ``calc_length(..., repeat_num=self._sampling_num)`` where
``_sampling_num = log2(reduction_factor)`` (the repeat count of the striding variant). For factor 4 the
lengths come out far too short, and ``ConformerEncoder`` rebuilds ``pad_mask`` / ``att_mask`` from them
for every layer after the reduction: valid frames are masked out as padding.
Fix: ``repeat_num=1`` for the pooling variant.

This program: a two-layer Conformer-style encoder (abs-pos multi-head attention, masked_fill with -10000
then softmax, NeMo's ``_create_masks``) with ``reduction='pooling'``, ``reduction_position=0``,
``reduction_factor=4``, on a batch of 20 and 18 frames. After pooling there are 5 frames; the real
lengths are [5, 4], the buggy ones [1, 1].
"""
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
INF_VAL = 10000.0


def calc_length(lengths, all_paddings, kernel_size, stride, ceil_mode, repeat_num=1):
    """Calculates the output length of a Tensor passed through a convolution or max pooling layer"""
    add_pad: float = all_paddings - kernel_size
    one: float = 1.0
    for i in range(repeat_num):
        lengths = torch.div(lengths.to(dtype=torch.float) + add_pad, stride) + one
        if ceil_mode:
            lengths = torch.ceil(lengths)
        else:
            lengths = torch.floor(lengths)
    return lengths.to(dtype=torch.int)


class SubsamplingReductionModule(nn.Module):
    """Downsamples the audio signal in time dimension."""

    def __init__(self, reduction: str, d_model: int, reduction_factor: int = 2):
        super().__init__()
        assert reduction in ["pooling"]
        self.reduction = reduction
        self.d_model = d_model
        self._sampling_num = int(math.log(reduction_factor, 2))
        self.reduction_enc = nn.MaxPool1d(kernel_size=reduction_factor)
        self.padding = 0
        self.kernel_size = self.reduction_enc.kernel_size
        self.stride = self.reduction_enc.stride

    def forward(self, x, lengths):
        x = torch.transpose(x, 1, 2)  # [B, C, T]
        lengths = calc_length(
            lengths=lengths,
            all_paddings=self.padding,
            kernel_size=self.kernel_size,
            stride=self.stride,
            ceil_mode=False,
            # a single MaxPool1d(kernel_size=reduction_factor) is applied below
            repeat_num=1 if FIXED else self._sampling_num,
        )
        x = self.reduction_enc(x)
        x = torch.transpose(x, 1, 2)  # [B, T, C]
        return x, lengths


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, n_feat):
        super().__init__()
        self.d_k, self.h = n_feat // n_head, n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)

    def forward(self, query, key, value, mask):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        mask = mask.unsqueeze(1)  # (batch, 1, time1, time2)
        scores = scores.masked_fill(mask, -INF_VAL)
        attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        x = torch.matmul(attn, v).transpose(1, 2).reshape(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)


class ConformerLayer(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.norm_self_att = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(n_heads, d_model)

    def forward(self, x, att_mask=None, pad_mask=None):
        y = self.norm_self_att(x)
        x = x + self.self_attn(y, y, y, att_mask)
        return x.masked_fill(pad_mask.unsqueeze(-1), 0.0)


class ConformerEncoder(nn.Module):
    def __init__(self, d_model=16, n_heads=2, n_layers=2, reduction="pooling", reduction_position=0,
                 reduction_factor=4):
        super().__init__()
        self.layers = nn.ModuleList(ConformerLayer(d_model, n_heads) for _ in range(n_layers))
        self.reduction_position = reduction_position
        self.reduction_subsampling = SubsamplingReductionModule(reduction, d_model, reduction_factor)

    def _create_masks(self, padding_length, max_audio_length, device):
        att_mask = torch.ones(1, max_audio_length, max_audio_length, dtype=torch.bool, device=device)
        pad_mask = torch.arange(0, max_audio_length, device=device).expand(
            padding_length.size(0), -1
        ) < padding_length.unsqueeze(-1)
        pad_mask_for_att_mask = pad_mask.unsqueeze(1).repeat([1, max_audio_length, 1])
        pad_mask_for_att_mask = torch.logical_and(pad_mask_for_att_mask, pad_mask_for_att_mask.transpose(1, 2))
        att_mask = att_mask[:, :max_audio_length, :max_audio_length]
        att_mask = torch.logical_and(pad_mask_for_att_mask, att_mask.to(pad_mask_for_att_mask.device))
        att_mask = ~att_mask
        pad_mask = ~pad_mask
        return pad_mask, att_mask

    def forward(self, audio_signal, length):
        max_audio_length = audio_signal.size(1)
        pad_mask, att_mask = self._create_masks(length, max_audio_length, audio_signal.device)
        for lth, layer in enumerate(self.layers):
            audio_signal = layer(x=audio_signal, att_mask=att_mask, pad_mask=pad_mask)
            if self.reduction_position == lth:
                audio_signal, length = self.reduction_subsampling(x=audio_signal, lengths=length)
                max_audio_length = audio_signal.size(1)
                pad_mask, att_mask = self._create_masks(length, max_audio_length, audio_signal.device)
        return audio_signal, length


def main():
    torch.manual_seed(0)
    encoder = ConformerEncoder().eval()
    length = torch.tensor([20, 18])
    audio_signal = torch.randn(2, 20, 16)
    with torch.no_grad():
        out, out_len = encoder(audio_signal, length)
    print("encoded", tuple(out.shape), "lengths", out_len.tolist())


if __name__ == "__main__":
    main()
