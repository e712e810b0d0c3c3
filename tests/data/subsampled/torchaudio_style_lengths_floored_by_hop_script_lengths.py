"""A torchaudio-style wav2vec2 front end whose frame lengths are the sample lengths floored by the total hop
(`lengths // 20`), where its three valid strided convolutions (10/5, 3/2, 3/2) make fewer frames: a short row's last
frame, computed partly from the padding, stays a key of the encoder's self-attention.

Written for maskcli's tests (checks/subsampled.py), the bug of asappresearch/sew PR #2 and fairseq#3227 (the frame mask
counted another way than the convolutions count) written otherwise: the batch's padding is stated only by the script's
own `wav_lens`, handed to the model call; the model reassigns its `lengths` argument to the frame lengths (as
torchaudio's components do), so no function of the model holds the sample lengths when it attends; the key padding goes
to nn.MultiheadAttention (batch_first) as `key_padding_mask`; three rows, the longest unpadded.
Fix (--fixed): the convolutions' own output length, (n - k) // s + 1 layer by layer.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

LAYERS = ((10, 5), (3, 2), (3, 2))  # (kernel, stride)
HOP = 5 * 2 * 2


class FeatureExtractor(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(1 if i == 0 else dim, dim, k, stride=s) for i, (k, s) in enumerate(LAYERS))

    def forward(self, waveforms, lengths):
        x = waveforms.unsqueeze(1)
        for conv in self.convs:
            x = nn.functional.gelu(conv(x))
        if FIXED:
            for k, s in LAYERS:
                lengths = torch.div(lengths - k, s, rounding_mode="floor") + 1
        else:
            lengths = torch.div(lengths, HOP, rounding_mode="floor")
        return x.transpose(1, 2), lengths.clamp(max=x.shape[-1])


class Wav2Vec2Like(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.feature_extractor = FeatureExtractor(dim)
        self.attention = nn.MultiheadAttention(dim, 2, batch_first=True)

    def forward(self, waveforms, lengths):
        x, lengths = self.feature_extractor(waveforms, lengths)
        key_padding_mask = torch.arange(x.shape[1])[None, :] >= lengths[:, None]
        out, _ = self.attention(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)
        return out, lengths


model = Wav2Vec2Like().eval()  # (grad enabled: nn.MultiheadAttention's math path, not the fused one)
wav_lens = torch.tensor([1000, 730, 560])
wavs = torch.zeros(3, 1000)
for i, n in enumerate(wav_lens.tolist()):
    wavs[i, :n] = torch.randn(n)
out, frames = model(wavs, wav_lens)
print("frames per row:", frames.tolist(), "of", out.shape[1])
