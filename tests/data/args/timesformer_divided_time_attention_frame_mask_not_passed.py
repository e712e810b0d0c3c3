# The same bug as lucidrains/vit-pytorch 4c89017 (ViViT's factorized_self_attention: the frame mask taken by
# ViT.forward and never passed on), written another way: a TimeSformer-style divided space-time block over clips of
# different lengths (padded frames at the end), its time attention an nn.MultiheadAttention over the frames of each
# patch, folded (patch, batch) -> rows. The model call takes attention_mask (B, F), 1 = a real frame, and uses it only to
# pool; the fix hands it, repeated over the patches in the same fold, to the time attention as key_padding_mask.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class DividedBlock(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.time = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.space = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm_t, self.norm_s = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x, frame_pad=None):
        b, f, p, d = x.shape
        t = self.norm_t(x).permute(2, 0, 1, 3).reshape(p * b, f, d)  # (patch batch) rows over the frames
        pad = None if frame_pad is None else frame_pad.repeat(p, 1)  # the same fold: row p * b + i is clip i
        t = self.time(t, t, t, key_padding_mask=pad, need_weights=False)[0]
        x = x + t.reshape(p, b, f, d).permute(1, 2, 0, 3)
        s = self.norm_s(x).reshape(b * f, p, d)  # each frame's patches
        s = self.space(s, s, s, need_weights=False)[0]
        return x + s.reshape(b, f, p, d)


class VideoEncoder(nn.Module):
    def __init__(self, dim=16, depth=2):
        super().__init__()
        self.embed = nn.Linear(12, dim)
        self.blocks = nn.ModuleList(DividedBlock(dim) for _ in range(depth))

    def forward(self, video, attention_mask):
        x = self.embed(video)  # (B, F, P, dim)
        frame_pad = (attention_mask == 0) if FIXED else None  # the bug: the frame mask never reaches the blocks
        for block in self.blocks:
            x = block(x, frame_pad)
        real = attention_mask[:, :, None, None].float()
        return (x * real).sum((1, 2)) / (real.sum((1, 2)) * x.shape[2])


frames = (4, 2, 3)
video = torch.randn(3, 4, 5, 12)
attention_mask = (torch.arange(4)[None, :] < torch.tensor(frames)[:, None]).long()
model = VideoEncoder().eval()
with torch.no_grad():
    batched = model(video, attention_mask)
    alone = torch.cat([model(video[i:i + 1, :n], attention_mask[i:i + 1, :n]) for i, n in enumerate(frames)])
print("max |batched - alone|:", float((batched - alone).abs().max()))
