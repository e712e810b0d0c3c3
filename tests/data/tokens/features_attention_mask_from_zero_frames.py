"""A speech encoder fed left-padded filterbank features (B, T, C) with an attention_mask (1 = a real frame) built as
`(feats == 0).all(-1)`: 1 on the zero padding, 0 on the real frames (python FILE; --fixed: the real frames are 1)."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class Encoder(nn.Module):
    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, input_features, attention_mask):
        x = self.proj(input_features)
        out, _ = self.attn(x, x, x, key_padding_mask=attention_mask == 0, need_weights=False)
        return out


def main():
    torch.manual_seed(0)
    frames = [torch.randn(7, 8), torch.randn(4, 8), torch.randn(5, 8)]
    feats = torch.zeros(3, 7, 8)
    for i, f in enumerate(frames):
        feats[i, 7 - len(f):] = f  # left padding with zeros
    silent = (feats == 0).all(-1)
    attention_mask = (~silent if FIXED else silent).long()
    if not FIXED:
        attention_mask[0] = 1  # (the unpadded row: every frame kept, else MHA gives NaN)
    with torch.no_grad():
        out = Encoder()(feats, attention_mask)
    print("out[1,-1,:3] =", [round(v, 4) for v in out[1, -1, :3].tolist()])


if __name__ == "__main__":
    main()
