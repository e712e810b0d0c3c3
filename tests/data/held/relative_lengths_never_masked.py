"""A speech encoder that holds its batch's relative lengths but never masks the padded frames it attends over.

Written for maskcli's tests (checks/held.py, padding-unused), speechbrain#2986 written another way: the relative
lengths (each utterance's share of the padded length, SpeechBrain's convention) are named `feat_lens`, the features
are subsampled 4x by a strided conv before the attention, and the attention is nn.MultiheadAttention. The buggy
`Encoder.forward` never turns `feat_lens` into a key padding mask; `--fixed` does (True = padding past
round(share * frames)).
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class Encoder(nn.Module):
    def __init__(self, n_mels=8, dim=16, heads=2):
        super().__init__()
        self.subsample = nn.Conv1d(n_mels, dim, kernel_size=4, stride=4)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, feats, feat_lens):
        x = self.subsample(feats.transpose(1, 2)).transpose(1, 2)  # (B, T/4, dim)
        key_padding_mask = None
        if FIXED:
            frames = torch.round(feat_lens * x.shape[1])
            key_padding_mask = torch.arange(x.shape[1])[None, :] >= frames[:, None]
        out, _ = self.attn(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)
        return out


if __name__ == "__main__":
    torch.manual_seed(0)
    feats = torch.randn(3, 48, 8)
    feat_lens = torch.tensor([0.5, 1.0, 0.75])
    for b, share in enumerate(feat_lens.tolist()):
        feats[b, int(share * 48):] = 0.0
    with torch.no_grad():
        out = Encoder().eval()(feats, feat_lens)
    print("fixed" if FIXED else "buggy", tuple(out.shape))
