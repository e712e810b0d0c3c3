"""A speech encoder written Tensor2Tensor / TF-port style: two strided Conv1d (kernel 5, stride 2, padding 2) over
padded filterbanks, the frame lengths counted by the same formula, and a key padding mask built from them with `<=`
(one frame too many: the first padded frame kept); the batch folded with its heads head-major (`mask.repeat(heads, 1)`,
as `tf.concat(tf.split(Q, h, axis=2), axis=0)` folds it) into one baddbmm + softmax. --fixed: `<`."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class FoldedSelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, keep):  # x: (B, T, D), keep: (B, T) True = real frame
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (torch.cat(torch.split(z, d // self.heads, dim=2), dim=0) for z in (q, k, v))  # (h*B, T, d/h)
        bias = torch.zeros(self.heads * b, 1, t).masked_fill(~keep.repeat(self.heads, 1)[:, None, :], -1e9)
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=(d // self.heads) ** -0.5)
        out = torch.bmm(torch.softmax(scores, dim=-1), v)
        return torch.cat(torch.split(out, b, dim=0), dim=2)


class Encoder(nn.Module):
    def __init__(self, feats=6, dim=16, heads=2):
        super().__init__()
        self.subsample = nn.Sequential(nn.Conv1d(feats, dim, 5, stride=2, padding=2), nn.ReLU(),
                                       nn.Conv1d(dim, dim, 5, stride=2, padding=2), nn.ReLU())
        self.attn = FoldedSelfAttention(dim, heads)

    def forward(self, speech, speech_lens):
        x = self.subsample(speech.transpose(1, 2)).transpose(1, 2)
        frames = speech_lens
        for _ in range(2):
            frames = (frames + 2 * 2 - 5) // 2 + 1
        at = torch.arange(x.shape[1])[None, :]
        keep = at < frames[:, None] if FIXED else at <= frames[:, None]
        return self.attn(x, keep)


def main():
    torch.manual_seed(0)
    enc = Encoder().eval()
    speech = torch.randn(3, 32, 6)
    speech_lens = torch.tensor([32, 21, 13])
    for row, n in enumerate(speech_lens.tolist()):
        speech[row, n:] = 0.0
    with torch.no_grad():
        out = enc(speech, speech_lens)
    print(out.shape)


if __name__ == "__main__":
    main()
