"""avex (representation_learning): the collator's padding_mask is True on real audio, BEATs wants True on padding.

Citation: earthspecies/avex#26 ("bug fix in padding -> beats and aves expect the inverse mask",
merged; commit 95a0c81 / merge 2006604). Read from the upstream git history: parent of 95a0c81
for data/audio_utils.py, data/dataset.py (Collater) and models/beats/beats.py.

Bug: ``pad_or_window`` returned ``mask = zeros; mask[:wav_len] = True`` (True = real samples)
and the Collater passed it as ``batch["padding_mask"]``. BEATs (fairseq convention) treats
``padding_mask`` True as *padding*: forward_padding_mask pools it to frames/patches, the
encoder zeroes ``x[padding_mask]`` and MultiheadAttention gets it as key_padding_mask. So every
real patch was zeroed and excluded as a key while the padded tail was attended to.

Fix: ``pad_or_window(..., invert=True)`` returns ``~mask`` (True = padding).

This program: Collater over two clips (900 and 1300 samples, target 1600), BEATs'
forward_padding_mask / patch embedding / encoder with nn.MultiheadAttention(key_padding_mask).
torchaudio's Kaldi fbank is replaced by a framed log-energy stand-in of the same frame layout
(torchaudio is not installed here); sizes are scaled down.
"""
import sys
from typing import Literal, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def pad_or_window(wav: torch.Tensor, target_len: int,
                  window_selection: Literal["random", "center", "start"] = "random",
                  invert: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pad or window a waveform to a target length."""
    wav_len = wav.size(-1)
    mask = torch.ones(target_len, dtype=torch.bool)
    processed_wav = wav
    if wav_len == target_len:
        pass
    elif wav_len > target_len:  # crop
        if window_selection == "center":
            start = (wav_len - target_len) // 2
        elif window_selection == "start":
            start = 0
        else:
            start = int(torch.randint(0, wav_len - target_len + 1, ()).item())
        processed_wav = wav[..., start:start + target_len]
    else:  # pad
        processed_wav = F.pad(wav, (0, target_len - wav_len))
        mask[wav_len:] = False
    if FIXED and invert:
        mask = ~mask
    return processed_wav, mask


class Collater:
    def __init__(self, audio_max_length_seconds: int, sr: int, window_selection: str = "random"):
        self.audio_max_length_seconds = audio_max_length_seconds
        self.sr = sr
        self.window_selection = window_selection

    def __call__(self, batch):
        audios, masks, labels = [], [], []
        for item in batch:
            wav = torch.as_tensor(item["raw_wav"])
            wav, pad_mask = pad_or_window(wav, self.audio_max_length_seconds * self.sr, self.window_selection)
            audios.append(wav)
            masks.append(pad_mask)
            labels.append(item["label"])
        return {"raw_wav": torch.stack(audios), "padding_mask": torch.stack(masks),
                "label": torch.tensor(labels, dtype=torch.long)}


class TransformerSentenceEncoderLayer(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(embed_dim, num_heads)  # fairseq layout (T, B, C)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, 2 * embed_dim)
        self.fc2 = nn.Linear(2 * embed_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def forward(self, x, self_attn_padding_mask=None):
        residual = x
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=self_attn_padding_mask, need_weights=False)
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        x = self.fc2(F.gelu(self.fc1(x)))
        return self.final_layer_norm(residual + x)


class TransformerEncoder(nn.Module):
    def __init__(self, embed_dim, num_heads, layers):
        super().__init__()
        self.layers = nn.ModuleList(TransformerSentenceEncoderLayer(embed_dim, num_heads) for _ in range(layers))

    def forward(self, x, padding_mask=None):
        if padding_mask is not None:
            x[padding_mask] = 0
        x = x.transpose(0, 1)  # B x T x C -> T x B x C
        for layer in self.layers:
            x = layer(x, self_attn_padding_mask=padding_mask)
        return x.transpose(0, 1), []


class BEATs(nn.Module):
    def __init__(self, num_mel_bins=16, input_patch_size=8, embed=32, heads=4, layers=2):
        super().__init__()
        self.num_mel_bins = num_mel_bins
        self.patch_embedding = nn.Conv2d(1, embed, kernel_size=input_patch_size, stride=input_patch_size, bias=False)
        self.layer_norm = nn.LayerNorm(embed)
        self.encoder = TransformerEncoder(embed, heads, layers)

    def forward_padding_mask(self, features: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        extra = padding_mask.size(1) % features.size(1)
        if extra > 0:
            padding_mask = padding_mask[:, :-extra]
        padding_mask = padding_mask.view(padding_mask.size(0), features.size(1), -1)
        padding_mask = padding_mask.all(-1)
        return padding_mask

    def preprocess(self, source: torch.Tensor, frame_length=32, frame_shift=16) -> torch.Tensor:
        # stand-in for ta_kaldi.fbank: (B, n_frames, num_mel_bins) log band energies
        frames = source.unfold(-1, frame_length, frame_shift)
        bands = frames.reshape(*frames.shape[:2], self.num_mel_bins, -1)
        return torch.log(bands.pow(2).mean(-1) + 1e-6)

    def extract_features(self, source: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        fbank = self.preprocess(source)
        if padding_mask is not None:
            padding_mask = self.forward_padding_mask(fbank, padding_mask)
        features = self.patch_embedding(fbank.unsqueeze(1))
        features = features.reshape(features.shape[0], features.shape[1], -1).transpose(1, 2)
        features = self.layer_norm(features)
        if padding_mask is not None:
            padding_mask = self.forward_padding_mask(features, padding_mask)
        x, _ = self.encoder(features, padding_mask=padding_mask)
        return x, padding_mask

    def forward(self, source, padding_mask=None):
        return self.extract_features(source, padding_mask)


def main():
    torch.manual_seed(0)
    collate = Collater(audio_max_length_seconds=1, sr=1600, window_selection="start")
    batch = collate([{"raw_wav": torch.randn(900), "label": 0}, {"raw_wav": torch.randn(1300), "label": 1}])
    backbone = BEATs().eval()
    with torch.no_grad():
        features, frame_padding = backbone(batch["raw_wav"], batch["padding_mask"])
    print(f"patches {features.shape[1]} patches flagged as padding per clip {frame_padding.sum(1).tolist()}")


if __name__ == "__main__":
    main()
