# Written another way (padding-convolved, beside voicebox-pytorch d079b26): a FastSpeech-style acoustic model puts a
# speaker token before the frames and masks the batch's padding in nn.MultiheadAttention by `key_padding_mask`
# (True = padding, the token's column padded with False); the convolutional position embedding before it runs over
# the padded frames, which hold sinusoidal positions and a bias, so the last real frames of a shorter row read them.
# The fix zeroes the padded frames before the convolution.
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def sinusoids(length, dim):
    position = torch.arange(length)[:, None].float()
    div = torch.exp(torch.arange(0, dim, 2).float() * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2], table[:, 1::2] = torch.sin(position * div), torch.cos(position * div)
    return table


class Acoustic(nn.Module):
    def __init__(self, n_mels=10, dim=24, heads=4, speakers=5):
        super().__init__()
        self.inp = nn.Linear(n_mels, dim)
        self.pos_conv = nn.Conv1d(dim, dim, kernel_size=9, padding=4, groups=4)
        self.speaker = nn.Embedding(speakers, dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.out = nn.Linear(dim, n_mels)

    def forward(self, mels, speaker_ids, key_padding_mask):
        h = self.inp(mels) + sinusoids(mels.shape[1], self.inp.out_features)
        if FIXED:
            h = h.masked_fill(key_padding_mask[..., None], 0.0)
        h = h + self.pos_conv(h.transpose(1, 2)).transpose(1, 2)
        h = torch.cat([self.speaker(speaker_ids)[:, None], h], dim=1)
        padding = torch.cat([key_padding_mask.new_zeros(len(h), 1), key_padding_mask], dim=1)
        h, _ = self.attn(h, h, h, key_padding_mask=padding, need_weights=False)
        return self.out(h[:, 1:])


model = Acoustic().eval()
frames = [torch.randn(n, 10) for n in (11, 16, 7)]
mels = nn.utils.rnn.pad_sequence(frames, batch_first=True)
lengths = torch.tensor([len(f) for f in frames])
key_padding_mask = torch.arange(mels.shape[1])[None] >= lengths[:, None]
speakers = torch.tensor([0, 3, 1])
with torch.no_grad():
    batched = model(mels, speakers, key_padding_mask)
    worst = max((batched[b, :n] - model(frames[b][None], speakers[b:b + 1], key_padding_mask[b:b + 1, :n])[0]).abs().max()
                for b, n in enumerate(lengths.tolist()))
print(f"fixed={FIXED} largest difference of a row from the row run alone: {worst:.2e}")
