"""A speech-token decoder whose config states its attention's sliding window under a prefix (`attention_sliding_window`)
beside the strides of its upsampling convolutions; the decoder builds a causal mask only.

Written another way from mlx-audio 0570bb1b (Voxtral TTS codec decoder: `attn_sliding_window_size` never applied):
here a dict config, two upsampling stages (transposed convolutions, stride 2 each) each followed by a self-attention
layer over the stage's frames, SDPA with a boolean mask. A frame at t should see frames t - 6 .. t (the window's 6
keys before it and itself); the mask lets it see every frame before it, so the last of 40 frames mixes in the first.
`--fixed`: the mask also drops keys more than `attention_sliding_window` frames back.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
CONFIG = {"hidden": 24, "heads": 4, "attention_sliding_window": 6, "upsample_conv_strides": [2, 2], "codebook": 32}


class Stage(nn.Module):
    def __init__(self, config, stride):
        super().__init__()
        d = config["hidden"]
        self.up = nn.ConvTranspose1d(d, d, kernel_size=stride, stride=stride)
        self.qkv, self.out, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), config["heads"]
        self.window = config["attention_sliding_window"]

    def forward(self, x):  # (B, T, D)
        x = self.up(x.transpose(1, 2)).transpose(1, 2)
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, -1))
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        allowed = j <= i
        if FIXED:
            allowed = allowed & (i - j <= self.window)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed = nn.Embedding(config["codebook"], config["hidden"])
        self.stages = nn.ModuleList(Stage(config, s) for s in config["upsample_conv_strides"])

    def forward(self, codes):
        x = self.embed(codes)
        for stage in self.stages:
            x = stage(x)
        return x


torch.manual_seed(0)
decoder = Decoder(CONFIG).eval()
codes = torch.randint(0, CONFIG["codebook"], (1, 10))
changed = codes.clone()
changed[0, 0] = (changed[0, 0] + 1) % CONFIG["codebook"]
with torch.no_grad():
    frames = decoder(codes)
    moved = (decoder(changed) - frames)[0, -1].abs().max().item()  # the last frame: 39 frames after the first code's
print(f"frames {tuple(frames.shape)}; the last frame moves by {moved:.3g} when the first code changes")
