"""NeMo TTS Aligner: the text-length mask handed to the alignment attention is not inverted.

Citation: NVIDIA/NeMo issue #6584 ("TTS Aligner Inference Example outputs attn_soft_tensor with nan
values") and PR #6677 ("Fix masking bug for TTS Aligner", which reverts the change of PR #5653); the
current nemo/collections/tts/models/aligner.py carries the fixed line. I read the issue, the PR
description and the current AlignmentEncoder / AlignerModel source, not the PR diff itself.

Bug: `AlignerModel.forward` passed `mask=get_mask_from_lengths(text_len).unsqueeze(-1)` (True on real
text tokens) to `AlignmentEncoder.forward`, whose contract is "True = mask element": it does
`attn.data.masked_fill_(mask.permute(0, 2, 1).unsqueeze(2), -inf)` then softmax over the text axis. So
real phonemes were hidden and padding kept: a full-length utterance gets a row of all -inf (NaN, as in
the issue) and a shorter one attends only to its padded text positions.
Fix: `mask=get_mask_from_lengths(text_len).unsqueeze(-1) == 0`.

This program keeps `AlignerModel.forward` and `AlignmentEncoder` (key / query ConvNorm projections,
Gaussian isotropic attention, `self.softmax = torch.nn.Softmax(dim=3)`), with small channel sizes and
random weights; the text embedding stands in for the model's `self.embed`. A batch of two utterances
with text lengths 6 and 4 and 10 mel frames, no attention prior (the inference example).
`--fixed` adds the `== 0`.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def get_mask_from_lengths(lengths, max_len=None):
    if max_len is None:
        max_len = lengths.max()
    ids = torch.arange(0, max_len, device=lengths.device, dtype=lengths.dtype)
    mask = ids < lengths.unsqueeze(1)
    return mask


class ConvNorm(nn.Conv1d):
    def __init__(self, in_channels, out_channels, kernel_size=1, bias=True, w_init_gain='linear'):
        super().__init__(in_channels, out_channels, kernel_size, padding=(kernel_size - 1) // 2, bias=bias)


class AlignmentEncoder(torch.nn.Module):
    """Module for alignment text and mel spectrogram."""

    def __init__(self, n_mel_channels=80, n_text_channels=512, n_att_channels=80, temperature=0.0005):
        super().__init__()
        self.temperature = temperature
        self.softmax = torch.nn.Softmax(dim=3)
        self.log_softmax = torch.nn.LogSoftmax(dim=3)
        self.key_proj = nn.Sequential(
            ConvNorm(n_text_channels, n_text_channels * 2, kernel_size=3, bias=True, w_init_gain='relu'),
            torch.nn.ReLU(),
            ConvNorm(n_text_channels * 2, n_att_channels, kernel_size=1, bias=True),
        )
        self.query_proj = nn.Sequential(
            ConvNorm(n_mel_channels, n_mel_channels * 2, kernel_size=3, bias=True, w_init_gain='relu'),
            torch.nn.ReLU(),
            ConvNorm(n_mel_channels * 2, n_mel_channels, kernel_size=1, bias=True),
            torch.nn.ReLU(),
            ConvNorm(n_mel_channels, n_att_channels, kernel_size=1, bias=True),
        )

    def forward(self, queries, keys, mask=None, attn_prior=None):
        """mask: B x T2 x 1 tensor (True = mask element, False = leave unchanged)."""
        keys_enc = self.key_proj(keys)  # B x n_attn_dims x T2
        queries_enc = self.query_proj(queries)  # B x n_attn_dims x T1
        # Simplistic Gaussian Isotopic Attention
        attn = (queries_enc[:, :, :, None] - keys_enc[:, :, None]) ** 2  # B x n_attn_dims x T1 x T2
        attn = -self.temperature * attn.sum(1, keepdim=True)
        if attn_prior is not None:
            attn = self.log_softmax(attn) + torch.log(attn_prior[:, None] + 1e-8)
        attn_logprob = attn.clone()
        if mask is not None:
            attn.data.masked_fill_(mask.permute(0, 2, 1).unsqueeze(2), -float("inf"))
        attn = self.softmax(attn)  # softmax along T2
        return attn, attn_logprob


class AlignerModel(nn.Module):
    def __init__(self, n_symbols=40, symbols_embedding_dim=16, n_mel_channels=8):
        super().__init__()
        self.embed = nn.Embedding(n_symbols, symbols_embedding_dim)
        self.alignment_encoder = AlignmentEncoder(n_mel_channels=n_mel_channels,
                                                  n_text_channels=symbols_embedding_dim,
                                                  n_att_channels=8, temperature=0.0005)

    def forward(self, *, spec, spec_len, text, text_len, attn_prior=None):
        mask = get_mask_from_lengths(text_len).unsqueeze(-1)
        if FIXED:
            mask = mask == 0
        attn_soft, attn_logprob = self.alignment_encoder(
            queries=spec,
            keys=self.embed(text).transpose(1, 2),
            mask=mask,
            attn_prior=attn_prior,
        )
        return attn_soft, attn_logprob


def main():
    torch.manual_seed(0)
    model = AlignerModel().eval()
    text = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 0, 0]])
    text_len = torch.tensor([6, 4])
    spec = torch.randn(2, 8, 10)
    spec_len = torch.tensor([10, 7])
    with torch.no_grad():
        attn_soft, _ = model(spec=spec, spec_len=spec_len, text=text, text_len=text_len)
    print("fixed" if FIXED else "buggy", tuple(attn_soft.shape),
          "nan rows:", int(torch.isnan(attn_soft).any(-1).sum()),
          "weight on text padding (utt 1):", round(float(attn_soft[1, 0, :, 4:].nansum()), 3))


if __name__ == "__main__":
    main()
