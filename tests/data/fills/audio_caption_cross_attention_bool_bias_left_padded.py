# The bug of VideoSys#116 (blind-ea's opendit_stdit_cross_attention_bool_mask_adds_one_to_valid_tokens) written
# another way: an audio-captioning decoder's cross-attention over left-padded text memory, 3-D (B*H, N, L) scores, its
# key bias made as a bool tensor and `masked_fill_(~keep, -1e4)` on it (so the pads hold True == 1.0), repeated over
# the heads and added with torch.add: nothing is masked, the padded memory keys are attended (and lifted by 1).
# The fix makes the bias in the scores' dtype.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class CaptionCrossAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def split(self, x):
        b, n, _ = x.shape
        return x.view(b, n, self.heads, self.head_dim).permute(0, 2, 1, 3).reshape(b * self.heads, n, self.head_dim)

    def forward(self, audio, text, text_keep):
        b, n, d = audio.shape
        q, k, v = self.split(self.to_q(audio)), self.split(self.to_k(text)), self.split(self.to_v(text))
        scores = torch.bmm(q, k.transpose(1, 2)) * self.head_dim ** -0.5  # (B*H, N, L)
        bias = torch.zeros(b, 1, text.shape[1], dtype=scores.dtype if FIXED else torch.bool)
        bias.masked_fill_(~text_keep[:, None, :], -1e4)
        scores = torch.add(scores, bias.repeat_interleave(self.heads, dim=0))
        weights = scores.softmax(dim=-1)
        out = torch.bmm(weights, v).view(b, self.heads, n, self.head_dim).permute(0, 2, 1, 3).reshape(b, n, d)
        return self.out(out)


B, N, L, D, H = 3, 10, 8, 32, 4
lengths = torch.tensor([8, 3, 5])
text_keep = torch.arange(L)[None, :] >= (L - lengths)[:, None]  # left padded: the real tokens at the end
layer = CaptionCrossAttention(D, H).eval()
audio, text = torch.randn(B, N, D), torch.randn(B, L, D)
with torch.no_grad():
    out = layer(audio, text, text_keep)
    ref = torch.cat([layer(audio[i:i + 1], text[i:i + 1, L - m:], torch.ones(1, m, dtype=torch.bool))
                     for i, m in enumerate(lengths.tolist())])
print(f"max |batched - each caption alone| = {(out - ref).abs().max().item():.6f}")
