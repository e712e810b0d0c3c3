"""The split-attention bug of musubi-tuner 5bb0a34 written another way: a video DiT's attention module, handed
`cu_seqlens` for its [video | padded text] rows (a valid segment then a padding segment per row, as HunyuanVideo's
get_cu_seqlens builds them), falls back, where no varlen kernel is installed, to an eager softmax loop over the batch
that attends each whole padded row: every video token sees the text padding of its own row. `--fixed` reads each row's
valid length from cu_seqlens and attends only those tokens, the rest of the row left zero."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

WIDTH, HEADS = 16, 2


def eager_varlen(q, k, v, cu_seqlens, max_seqlen):
    """q, k, v: (B * max_seqlen, heads, dim) flattened; cu_seqlens: [valid, padding] segment ends per row."""
    rows = q.shape[0] // max_seqlen
    q, k, v = (t.view(rows, max_seqlen, HEADS, -1).transpose(1, 2) for t in (q, k, v))
    out = torch.zeros_like(q)
    for i in range(rows):
        valid = int(cu_seqlens[2 * i + 1] - cu_seqlens[2 * i]) if FIXED else max_seqlen
        scores = q[i:i + 1, :, :valid] @ k[i:i + 1, :, :valid].transpose(-1, -2) / q.shape[-1] ** 0.5
        out[i:i + 1, :, :valid] = torch.softmax(scores, dim=-1) @ v[i:i + 1, :, :valid]
    return out.transpose(1, 2).reshape(rows * max_seqlen, HEADS, -1)


class VarlenAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, cu_seqlens, max_seqlen):
        b, l, _ = x.shape
        q, k, v = self.qkv(x).view(b * l, 3, HEADS, -1).unbind(1)
        return self.proj(eager_varlen(q, k, v, cu_seqlens, max_seqlen).reshape(b, l, WIDTH))


class TinyVideoDiT(nn.Module):
    def __init__(self):
        super().__init__()
        self.video_in, self.text_in = nn.Linear(4, WIDTH), nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList([VarlenAttention() for _ in range(2)])

    def forward(self, video, text, text_mask):
        x = torch.cat([self.video_in(video), self.text_in(text)], dim=1)  # [video | text], the text padded
        b, l, _ = x.shape
        valid = video.shape[1] + text_mask.sum(dim=1)
        cu_seqlens = torch.zeros(2 * b + 1, dtype=torch.int32)
        for i in range(b):
            cu_seqlens[2 * i + 1] = i * l + valid[i]
            cu_seqlens[2 * i + 2] = (i + 1) * l
        for block in self.blocks:
            x = x + block(x, cu_seqlens=cu_seqlens, max_seqlen=l)
        return x[:, :video.shape[1]]


model = TinyVideoDiT().eval()
lengths = [3, 5, 2]
B, N, T = len(lengths), 8, 6
video, text = torch.randn(B, N, 4), torch.randn(B, T, 8)
text_mask = torch.zeros(B, T, dtype=torch.long)
for i, n in enumerate(lengths):
    text_mask[i, :n] = 1
with torch.no_grad():
    out = model(video, text, text_mask)
    alone = [model(video[i:i + 1], text[i:i + 1, :n], torch.ones(1, n, dtype=torch.long)) for i, n in enumerate(lengths)]
print("max |batched - one sample alone| =", max((out[i] - a[0]).abs().max().item() for i, a in enumerate(alone)))
