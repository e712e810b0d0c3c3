"""A latent cross-attention (Perceiver-style resampler over a padded text) whose per-sample loop trims the latent
queries by the text lengths as well as the keys: `q[b, :, :n]` with n = text_lens[b], so latents n.. of each row
attend nothing and stay zero. Written for maskcli's queries-unpadded-by-keys beside vllm-omni#5865, another way: a
hand-written softmax in a loop over the batch, the text padding held as lengths, fewer keys than latents.

`--fixed`: every latent attends the row's n real keys (`q[b]` whole).
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class LatentCrossAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.is_cross_attention = True
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(dim, 2 * dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, latents, text, text_lens):
        b, lq, _ = latents.shape
        lk = text.shape[1]
        q = self.to_q(latents).view(b, lq, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.to_kv(text).view(b, lk, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = torch.zeros_like(q)
        for i in range(b):
            n = int(text_lens[i])
            rows = slice(None) if FIXED else slice(0, n)
            scores = q[i:i + 1, :, rows] @ k[i:i + 1, :, :n].transpose(-1, -2) * self.head_dim ** -0.5
            out[i:i + 1, :, rows] = scores.softmax(dim=-1) @ v[i:i + 1, :, :n]
        return self.to_out(out.transpose(1, 2).reshape(b, lq, -1))


def main():
    torch.manual_seed(0)
    dim = 16
    resampler = LatentCrossAttention(dim, heads=2).eval()
    latents = torch.randn(3, 8, dim)
    text = torch.randn(3, 6, dim)
    text_lens = torch.tensor([6, 2, 4])
    with torch.no_grad():
        out = resampler(latents, text, text_lens)
    print("out", tuple(out.shape), "sum %.4f" % out.sum().item())


if __name__ == "__main__":
    main()
