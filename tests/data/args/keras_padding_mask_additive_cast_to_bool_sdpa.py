"""A Keras-ported video encoder whose additive mask (0 / -1e9) is cast to bool for SDPA: True where -1e9, so the padded
frames are attended and the real ones hidden (the mask the wrong way round).

Written for maskcli's tests (checks/arguments.py), the bug of huggingface/transformers PR #48817 (Nemotron ASR's eager
path applies `masked_fill_(attention_mask.logical_not(), -inf)` to an additive float mask) written otherwise: the
encoder takes a KerasHub-style `padding_mask`, True on the real frames (no ids beside it: its rows say which way round
it is, one of them whole), builds the additive mask as BERT ports do, and hands SDPA `extended.bool()`, which reads True
as "may attend"; three rows, left-padded (the first program's were right-padded), no chunking.
Fix (--fixed): `extended == 0`, True where the additive mask adds nothing.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

D, H, T = 16, 2, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x, extended):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        keep = extended == 0 if FIXED else extended.bool()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return x + self.out(y.transpose(1, 2).reshape(b, t, D))


class VideoEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, frames, padding_mask):
        # padding_mask: (B, T), True on the real frames (Keras's convention)
        extended = (1.0 - padding_mask[:, None, None, :].float()) * -1e9
        x = frames
        for block in self.blocks:
            x = block(x, extended)
        return x


encoder = VideoEncoder().eval()
counts = [6, 4, 2]
padding_mask = torch.tensor([[i >= T - n for i in range(T)] for n in counts])  # left-padded
frames = torch.randn(3, T, D) * padding_mask[..., None]
with torch.no_grad():
    out = encoder(frames, padding_mask)
print("nan rows:", int(torch.isnan(out).any(-1).sum()))
