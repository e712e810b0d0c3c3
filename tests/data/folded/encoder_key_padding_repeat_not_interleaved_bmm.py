# Written another way than ProphetNet's (transformers#17455, fixed by #21870: `attention_mask[:, None, :].repeat(heads,
# 1, 1)` added to batch-major `bsz * heads` scores): a hand-written text encoder over a right-padded batch of three,
# its scores `torch.bmm` of queries reshaped from (B, H, L, D) to (B * H, L, D), masked with `masked_fill(-inf)` where
# the key padding, laid on the heads with `.repeat(heads, 1, 1)` (head-major), is True. So head h of sample b takes
# sample (b * H + h) % B's padding. Fix: `.repeat_interleave(heads, 0)`, batch-major as the scores are.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SelfAttention(nn.Module):
    def __init__(self, dim=24, heads=3):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, key_padding):  # key_padding: (B, L), True = a pad
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).permute(0, 2, 1, 3).contiguous() for z in self.qkv(x).chunk(3, -1))
        q, k, v = (z.reshape(b * self.heads, t, -1) for z in (q, k, v))
        scores = torch.bmm(q, k.transpose(1, 2)) / (d // self.heads) ** 0.5
        pads = key_padding.repeat_interleave(self.heads, 0) if FIXED else key_padding.repeat(self.heads, 1)
        scores = scores.masked_fill(pads[:, None, :], float("-inf"))
        out = torch.bmm(scores.softmax(-1), v).view(b, self.heads, t, -1).permute(0, 2, 1, 3).reshape(b, t, d)
        return self.proj(out)


class TextEncoder(nn.Module):
    def __init__(self, vocab=30, dim=24):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.attn = SelfAttention(dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        return self.norm(x + self.attn(x, attention_mask == 0))


encoder = TextEncoder().eval()
texts = [[4, 9, 13, 2, 7], [5, 3, 8], [11, 6, 2, 9]]
width = max(map(len, texts))
input_ids = torch.tensor([t + [0] * (width - len(t)) for t in texts])
attention_mask = (input_ids != 0).long()
with torch.no_grad():
    pooled = (encoder(input_ids, attention_mask) * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)
print(f"{'fixed' if FIXED else 'buggy'}: pooled {tuple(pooled.shape)}")
