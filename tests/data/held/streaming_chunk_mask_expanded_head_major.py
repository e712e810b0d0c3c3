"""A streaming speech encoder (sequence-first nn.MultiheadAttention, as torchaudio's Emformer and ESPnet feed it): each
right-padded utterance's real frames see their own chunk of 2 and the chunks before it, and not the frames past the
utterance's end (its padding frames' rows are dropped after the encoder, so they are left unmasked but for the
chunks: no row is empty). The per-utterance (T, T) mask is made per head by `unsqueeze(0).expand(heads, ...)` and a reshape,
head-major, while the kernel reads its (B * heads, T, T) mask at b * heads + h: heads of one utterance get another
utterance's end, and the longest utterance loses its last frames in some heads. --fixed expands on a new axis after
the batch (one utterance's heads together).
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
CHUNK = 2


def chunk_masks(lengths, frames):
    """(B, T, T) True = masked: a frame sees its own and earlier chunks, and a real frame only its utterance's frames."""
    position = torch.arange(frames)
    later_chunk = (position[None, :] // CHUNK) > (position[:, None] // CHUNK)
    real = position[None, :] < lengths[:, None]
    return later_chunk[None] | (real[:, :, None] & ~real[:, None, :])


class StreamingLayer(nn.Module):
    def __init__(self, width=16, heads=4):
        super().__init__()
        self.heads = heads
        self.attn = nn.MultiheadAttention(width, heads)
        self.norm = nn.LayerNorm(width)

    def forward(self, frames, lengths):
        t_len, batch, _ = frames.shape
        per_utterance = chunk_masks(lengths, t_len)
        if FIXED:
            per_head = per_utterance.unsqueeze(1).expand(batch, self.heads, t_len, t_len)
        else:
            per_head = per_utterance.unsqueeze(0).expand(self.heads, batch, t_len, t_len)
        per_head = per_head.reshape(batch * self.heads, t_len, t_len)
        padding = torch.arange(t_len)[None, :] >= lengths[:, None]
        out, _ = self.attn(frames, frames, frames, attn_mask=per_head, key_padding_mask=padding)
        return self.norm(frames + out)


def main():
    torch.manual_seed(0)
    lengths = torch.tensor([8, 5, 6])
    layers = nn.ModuleList([StreamingLayer() for _ in range(2)]).eval()
    frames = torch.randn(8, 3, 16)
    with torch.no_grad():
        x = frames
        for layer in layers:
            x = layer(x, lengths)
        alone = frames[:, :1]
        for layer in layers:
            alone = layer(alone, lengths[:1])
    print("max |utterance 0 batched - alone|: %.4f" % (x[:, 0] - alone[:, 0]).abs().max().item())


if __name__ == "__main__":
    main()
