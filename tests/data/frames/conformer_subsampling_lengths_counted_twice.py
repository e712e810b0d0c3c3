"""A speech encoder whose frame padding is computed for a subsampling twice as deep as the one that runs.

Written for maskcli's tests, as conformer-style speech encoders (ESPnet / NeMo Conv2dSubsampling) write it: log-mel
`input_features` (B, T, 16) left-padded in time, `attention_mask` (B, T) 1 = a real frame; one stride-2 convolution
makes T' = (T - 1) // 2 + 1 frames, and `nn.MultiheadAttention` is handed key_padding_mask (True = padding) over them.
Bug: the frame lengths are divided by 4 (`lengths // 4`, a 4x subsampling the config once had), so most real frames
of every utterance, the unpadded one included, are padding to the encoder. Fixed: the stride-2 output length.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class Encoder(nn.Module):
    def __init__(self, mels=16, dim=32, heads=4):
        super().__init__()
        self.subsample = nn.Conv1d(mels, dim, kernel_size=3, stride=2, padding=1)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def output_lengths(self, lengths):
        return (lengths - 1) // 2 + 1 if FIXED else lengths // 4

    def forward(self, input_features, attention_mask):
        x = self.subsample(input_features.transpose(1, 2)).transpose(1, 2)  # (B, T', dim)
        frames = self.output_lengths(attention_mask.sum(-1))
        at = torch.arange(x.shape[1])
        key_padding_mask = at[None, :] < (x.shape[1] - frames)[:, None]  # left padding: the first frames are pads
        out, _ = self.attn(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)
        return out


if __name__ == "__main__":
    torch.manual_seed(0)
    encoder = Encoder().eval()
    attention_mask = torch.ones(3, 20, dtype=torch.long)
    attention_mask[1, :6] = 0
    attention_mask[2, :12] = 0
    input_features = torch.randn(3, 20, 16) * attention_mask[:, :, None]
    with torch.no_grad():
        out = encoder(input_features, attention_mask=attention_mask)
    print("encoder output", tuple(out.shape))
