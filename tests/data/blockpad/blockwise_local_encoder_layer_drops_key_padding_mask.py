# The same bug as h-transformer-1d 4e7f4fc, written another way: a speech-style encoder whose attention is blockwise
# local (each block of 4 frames attends within itself, scores laid out (batch, heads, blocks, 4, 4) and folded to
# (batch * heads, blocks, 4, 4)), over a LEFT-padded batch of three utterances. The encoder holds the batch's
# `src_key_padding_mask` (True = padding) and hands it to every layer, but the layer calls `self.attn(x)` without
# it, so a block that straddles a row's padding lets real frames attend to the padded ones. The fix hands it on.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class BlockLocalAttention(nn.Module):
    def __init__(self, d_model=16, num_heads=2, block=4):
        super().__init__()
        self.num_heads, self.block = num_heads, block
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x, key_padding_mask=None):
        bsz, t, d = x.shape
        h, w = self.num_heads, self.block
        q, k, v = self.qkv(x).view(bsz, t // w, w, 3, h, d // h).permute(3, 0, 4, 1, 2, 5)  # 3, b, h, n, w, e
        q, k, v = (z.reshape(bsz * h, t // w, w, d // h) for z in (q, k, v))
        scores = torch.einsum("bnie,bnje->bnij", q, k) / (d // h) ** 0.5
        if key_padding_mask is not None:
            pad = key_padding_mask.view(bsz, 1, t // w, 1, w).expand(-1, h, -1, -1, -1).reshape(bsz * h, t // w, 1, w)
            scores = scores.masked_fill(pad, float("-inf"))
        attn = F.softmax(scores, dim=-1).nan_to_num(0.0)  # (a block of padding only: no key, zero weights)
        out = torch.einsum("bnij,bnje->bnie", attn, v).reshape(bsz, h, t, d // h).transpose(1, 2).reshape(bsz, t, d)
        return self.proj(out)


class EncoderLayer(nn.Module):
    def __init__(self, d_model=16):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.attn = BlockLocalAttention(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, 32), nn.ReLU(), nn.Linear(32, d_model))

    def forward(self, x, src_key_padding_mask=None):
        if FIXED:
            x = x + self.attn(self.norm(x), key_padding_mask=src_key_padding_mask)
        else:
            x = x + self.attn(self.norm(x))
        return x + self.ff(x)


class Encoder(nn.Module):
    def __init__(self, feats=8, d_model=16, layers=2):
        super().__init__()
        self.inp = nn.Linear(feats, d_model)
        self.layers = nn.ModuleList(EncoderLayer(d_model) for _ in range(layers))

    def forward(self, feats, src_key_padding_mask):
        x = self.inp(feats)
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=src_key_padding_mask)
        return x


encoder = Encoder().eval()
frames = [16, 10, 13]
t = 16
src_key_padding_mask = torch.tensor([[i < t - n for i in range(t)] for n in frames])  # left padding
feats = torch.randn(3, t, 8).masked_fill(src_key_padding_mask[..., None], 0.0)
with torch.no_grad():
    out = encoder(feats, src_key_padding_mask)
    # reference: row 1 with its padding frames replaced: real frames whose block holds no padding must not change
    other = feats.clone()
    other[1, : t - frames[1]] = torch.randn(t - frames[1], 8)
    moved = encoder(other, src_key_padding_mask)
print("max |row 1's real frames, padding frames changed|: %.6f"
      % (out[1, t - frames[1]:] - moved[1, t - frames[1]:]).abs().max().item())
