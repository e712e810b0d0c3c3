"""A streaming speech encoder, written as WeNet writes one: a Conv2dSubsampling4 front end (two 3x3 convolutions of
stride 2 over time, no padding) and a chunk mask (each frame sees its own chunk and every earlier one) and'd with the
key padding. The bug: the key padding is built from `xs_lens` as handed in, counted in input frames, where the front
end made (n - 3) // 2 + 1 frames of n, twice; a short utterance's frames made of its padding stay keys its real frames
attend (its last chunk's). --fixed subsamples the lengths as the convolutions count them. Attention is a hand-written
masked_fill softmax over heads; three utterances of 64, 41 and 23 input frames, right-padded. The program checks the
fix against each utterance run alone."""

import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D, HEADS, CHUNK = 16, 2, 4


class Conv2dSubsampling4(nn.Module):
    def __init__(self, idim: int):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, D, 3, 2), nn.ReLU(), nn.Conv2d(D, D, 3, 2), nn.ReLU())
        self.out = nn.Linear(D * (((idim - 1) // 2 - 1) // 2), D)

    def forward(self, x):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        return self.out(x.transpose(1, 2).contiguous().view(b, t, c * f))


def subsequent_chunk_mask(size: int, chunk: int) -> torch.Tensor:
    ret = torch.zeros(size, size, dtype=torch.bool)
    for i in range(size):
        ending = min((i // chunk + 1) * chunk, size)
        ret[i, 0:ending] = True
    return ret


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / (q.shape[-1] ** 0.5)
        scores = scores.masked_fill(~mask.unsqueeze(1), -float("inf"))
        attn = torch.softmax(scores, dim=-1).masked_fill(~mask.unsqueeze(1), 0.0)
        return self.out((attn @ v).transpose(1, 2).reshape(b, t, D))


class Encoder(nn.Module):
    def __init__(self, idim: int = 20):
        super().__init__()
        self.embed = Conv2dSubsampling4(idim)
        self.layers = nn.ModuleList(SelfAttention() for _ in range(2))

    def forward(self, xs, xs_lens):
        xs = self.embed(xs)
        t = xs.size(1)
        lens = ((xs_lens - 3) // 2 + 1 - 3) // 2 + 1 if FIXED else xs_lens
        masks = (torch.arange(t)[None, :] < lens[:, None]).unsqueeze(1)  # (B, 1, T) key padding
        chunk_masks = subsequent_chunk_mask(t, CHUNK)[None] & masks
        for layer in self.layers:
            xs = xs + layer(xs, chunk_masks)
        return xs, lens


encoder = Encoder().eval()
xs_lens = torch.tensor([64, 41, 23])
xs = torch.randn(3, 64, 20) * (torch.arange(64)[None, :, None] < xs_lens[:, None, None])
with torch.no_grad():
    out, lens = encoder(xs, xs_lens)
    for i in range(3):
        alone, _ = encoder(xs[i:i + 1, :int(xs_lens[i])], xs_lens[i:i + 1])
        n = alone.shape[1]
        print(f"utterance {i}: {n} frames alone, max difference batched {float((out[i, :n] - alone[0]).abs().max()):.2e}")
        if FIXED:
            assert torch.allclose(out[i, :n], alone[0], atol=1e-5)
