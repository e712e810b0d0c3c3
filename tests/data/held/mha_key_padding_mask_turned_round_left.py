"""A left-padded batch whose `padding_mask` (True = padding) reaches nn.MultiheadAttention turned round.

Written for maskcli's tests (not a published bug): the second program padding-only-attended catches (the first:
neuro-galaxy/torch_brain#74's xformers bias filled where the keep-mask is True, tests/data/bugs). The collator pads
on the left and returns `padding_mask`, True on the padding, in the dict the encoder is handed; the encoder hands nn.MultiheadAttention
`key_padding_mask=~padding_mask`, as if the mask meant "True = real": every query of a padded row attends the padding
only (the unpadded row's queries see no key at all).
Fix (--fixed): `key_padding_mask=padding_mask`, which MHA reads as True = ignore.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def collate(rows, width):
    x = torch.zeros(len(rows), width, 8)
    padding_mask = torch.ones(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        x[i, width - len(row):] = row
        padding_mask[i, width - len(row):] = False
    return x, padding_mask


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)

    def forward(self, batch):
        x, padding_mask = batch["x"], batch["padding_mask"]
        kpm = padding_mask if FIXED else ~padding_mask
        out, _ = self.attn(x, x, x, key_padding_mask=kpm, need_weights=False)
        return self.norm(x + out.nan_to_num())


def main():
    torch.manual_seed(0)
    rows = [torch.randn(3, 8), torch.randn(5, 8), torch.randn(4, 8)]
    x, padding_mask = collate(rows, 6)
    with torch.no_grad():
        out = Encoder().eval()({"x": x, "padding_mask": padding_mask})
    print("fixed" if FIXED else "buggy", f"{out[:, -1].sum().item():.4f}")


if __name__ == "__main__":
    main()
