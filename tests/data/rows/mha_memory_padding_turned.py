"""A decoder whose nn.MultiheadAttention cross-attention is handed its memory's real-token mask as key_padding_mask.

Written here (a second program for memory-padding-inverted, beside 3D-MoLM's blind reproduction lsh0520/3D-MoLM#8):
the encoder (nn.TransformerEncoderLayer) masks each source row's right padding with `src_key_padding_mask` (True =
padding, from the sizes); the decoder's cross-attention is handed `real = ~pad`, which nn.MultiheadAttention also
reads as True = padding, so the decoder's queries of a padded row see only the padding of its memory. `--fixed`
hands `pad`.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class Model(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(dim, heads, 32, dropout=0.0, batch_first=True)
        self.decoder = nn.ModuleDict({"cross": nn.MultiheadAttention(dim, heads, batch_first=True)})

    def forward(self, source, sizes, target):
        pad = torch.arange(source.shape[1])[None, :] >= sizes[:, None]
        memory = self.encoder(source, src_key_padding_mask=pad)
        real = ~pad
        out, _ = self.decoder["cross"](target, memory, memory, key_padding_mask=pad if FIXED else real,
                                       need_weights=False)
        return out


def main():
    torch.manual_seed(0)
    model = Model().eval()
    source, target = torch.randn(3, 6, 16), torch.randn(3, 2, 16)
    with torch.no_grad():
        out = model(source, torch.tensor([6, 4, 3]), target)
    print("out", tuple(out.shape))


if __name__ == "__main__":
    main()
