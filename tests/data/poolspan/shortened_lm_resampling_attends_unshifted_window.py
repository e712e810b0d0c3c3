"""A shortened byte LM (Nawrot et al.'s hourglass, written with SDPA): the sequence is shifted right by s - 1 with
`torch.cat`, zero-padded to a multiple of s = 3, pooled with `F.avg_pool1d`, and each pooled token is resampled by one
query over its window of s tokens, cut with `unfold`. The windows are cut from the unshifted sequence, so the pooled
token of window n, used from position n·s on, attends bytes n·s + 1 .. n·s + 2 (python FILE; --fixed: the windows
are cut from the shifted sequence the query was pooled from). The same bug as hourglass-transformer-pytorch d7dc1e0,
written another way: 22 bytes padded to 24, a copy of the windows rather than a view, SDPA, s = 3."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class SelfBlock(nn.Module):
    def __init__(self, d=24, heads=3, causal=True):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return x + self.out(o.transpose(1, 2).reshape(b, n, d))


class Resampler(nn.Module):
    """One query per window over the window's tokens: a single query needs no mask (the module is causal all the same)."""

    def __init__(self, d=24, heads=3, causal=True):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q, self.kv, self.out = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, pooled, window):
        r, s, d = window.shape
        q = self.q(pooled).view(r, 1, self.heads, -1).transpose(1, 2)
        k, v = (t.view(r, s, self.heads, -1).transpose(1, 2) for t in self.kv(window).chunk(2, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v)
        return pooled + self.out(o.transpose(1, 2).reshape(r, 1, d))


class ShortenedLM(nn.Module):
    def __init__(self, vocab=256, d=24, shorten=3):
        super().__init__()
        self.shorten = shorten
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(64, d)
        self.pre, self.valley, self.post = SelfBlock(d), SelfBlock(d), SelfBlock(d)
        self.resample = Resampler(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        b, length = ids.shape
        s = self.shorten
        x = self.embed(ids) + self.pos(torch.arange(length))[None]
        x = self.pre(x)
        x = F.pad(x, (0, 0, 0, -length % s))  # to a multiple of s
        shifted = torch.cat((x.new_zeros(b, s - 1, x.shape[-1]), x[:, : x.shape[1] - (s - 1)]), dim=1)
        pooled = F.avg_pool1d(shifted.transpose(1, 2), s).transpose(1, 2)  # (b, n, d)
        n = pooled.shape[1]
        source = shifted if FIXED else x
        windows = source.unfold(1, s, s).permute(0, 1, 3, 2).reshape(b * n, s, -1)  # (b n) s d
        short = self.resample(pooled.reshape(b * n, 1, -1), windows).view(b, n, -1)
        short = self.valley(short)
        x = x + short.repeat_interleave(s, dim=1)
        return self.head(self.post(x)[:, :length])


def main():
    torch.manual_seed(0)
    model = ShortenedLM().eval()
    ids = torch.randint(0, 256, (2, 22))
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256  # a byte inside window 3 (positions 9 .. 11)
    with torch.no_grad():
        leak = (model(ids)[:, :10] - model(changed)[:, :10]).abs().max().item()
    print(f"fixed={FIXED} change of logits before byte 10 when byte 10 changes = {leak:.6f}")


main()
