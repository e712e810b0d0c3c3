# The sinks-dropped bug written another way (not a published program): a windowed patch encoder whose block holds a
# learned sink logit per head (`self.sinks`, a dataclass config's `use_sinks=True`) and runs nn.MultiheadAttention over
# a right-padded batch of two images, with a bool *block* band mask and a key_padding_mask. Before: the sinks are held
# and never handed to the kernel, so every head attends as if it had none. After (--fixed): one 3-D float attn_mask
# (B * H, L, L): -inf where the band or the padding blocks a key, and sinks[h] added to the logit of each image's
# first key (MiMo's vision reference form), handed to the same nn.MultiheadAttention.
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class EncoderConfig:
    hidden: int = 24
    heads: int = 3
    layers: int = 2
    window: int = 2  # each patch sees the patches at most `window` away, both sides
    use_sinks: bool = True
    sink_init: list = field(default_factory=lambda: [1.5, -0.5, 2.5])


class SinkWindowBlock(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.heads, self.window = cfg.heads, cfg.window
        self.norm = nn.LayerNorm(cfg.hidden)
        self.attn = nn.MultiheadAttention(cfg.hidden, cfg.heads, batch_first=True)
        self.use_sinks = cfg.use_sinks
        self.sinks = nn.Parameter(torch.tensor(cfg.sink_init)) if cfg.use_sinks else None

    def forward(self, x, lengths):
        b, n, _ = x.shape
        pos = torch.arange(n)
        band_blocks = (pos[:, None] - pos[None, :]).abs() > self.window  # (n, n) bool, True = blocked
        pad_blocks = pos[None, :] >= lengths[:, None]  # (b, n) bool, True = a padding key
        h = self.norm(x)
        if not FIXED:
            out, _ = self.attn(h, h, h, attn_mask=band_blocks, key_padding_mask=pad_blocks, need_weights=False)
        else:
            blocked = band_blocks[None] | pad_blocks[:, None, :]  # (b, n, n)
            bias = torch.zeros(b, self.heads, n, n).masked_fill(blocked[:, None], float("-inf"))
            bias[:, :, :, 0] += self.sinks.view(1, self.heads, 1)  # each image's first key carries the head's sink
            out, _ = self.attn(h, h, h, attn_mask=bias.reshape(b * self.heads, n, n), need_weights=False)
        return x + out


class WindowEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.embed = nn.Linear(12, cfg.hidden)
        self.blocks = nn.ModuleList(SinkWindowBlock(cfg) for _ in range(cfg.layers))

    def forward(self, patches, lengths):
        x = self.embed(patches)
        for block in self.blocks:
            x = block(x, lengths)
        return x


cfg = EncoderConfig()
model = WindowEncoder(cfg).eval()
lengths = torch.tensor([7, 5])  # two images of 7 and 5 patches, the second right-padded to 7
patches = torch.randn(2, 7, 12)
with torch.no_grad():
    y = model(patches, lengths)
print("fixed" if FIXED else "buggy", tuple(y.shape), "checksum %.5f" % y[0].sum().item())
