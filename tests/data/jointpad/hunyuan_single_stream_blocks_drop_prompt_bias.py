"""The single-stream padding bug of sd-scripts 2e89cd2c (Flux's single blocks never handed the T5 mask its double
blocks apply) written another way: a HunyuanVideo-style DiT whose joint sequence puts the video first and the LLaMA
prompt after it, the prompt's padding applied in the dual-stream blocks as an additive float bias (finfo.min on the
padded keys), and the single-stream blocks, handed the joined [video, prompt] stream, called with no bias at all;
`--fixed` hands them the same bias."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

WIDTH, HEADS = 32, 2


def attend(q, k, v, bias=None):
    b, l, _ = q.shape
    q, k, v = (t.view(b, -1, HEADS, WIDTH // HEADS).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, -1, WIDTH)


class DualStreamBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.img_qkv, self.txt_qkv = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, 3 * WIDTH)
        self.img_out, self.txt_out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, img, txt, bias):
        qkv = torch.cat([self.img_qkv(img), self.txt_qkv(txt)], dim=1)  # [video, prompt]
        out = attend(*qkv.chunk(3, dim=-1), bias=bias)
        return img + self.img_out(out[:, :img.shape[1]]), txt + self.txt_out(out[:, img.shape[1]:])


class SingleStreamBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, bias=None):
        return x + self.out(attend(*self.qkv(self.norm(x)).chunk(3, dim=-1), bias=bias))


class TinyHunyuanVideo(nn.Module):
    def __init__(self):
        super().__init__()
        self.img_in, self.txt_in = nn.Linear(6, WIDTH), nn.Linear(10, WIDTH)
        self.double_blocks = nn.ModuleList([DualStreamBlock() for _ in range(2)])
        self.single_blocks = nn.ModuleList([SingleStreamBlock() for _ in range(2)])
        self.final = nn.Linear(WIDTH, 6)

    def forward(self, x, text_states, prompt_attention_mask):
        img, txt = self.img_in(x), self.txt_in(text_states)
        keep = torch.cat([torch.ones(img.shape[:2], dtype=torch.bool), prompt_attention_mask.bool()], dim=1)
        bias = torch.zeros(keep.shape, dtype=img.dtype).masked_fill(~keep, torch.finfo(img.dtype).min)[:, None, None, :]
        for block in self.double_blocks:
            img, txt = block(img, txt, bias)
        joined = torch.cat([img, txt], dim=1)
        for block in self.single_blocks:
            joined = block(joined, bias) if FIXED else block(joined)
        return self.final(joined[:, :img.shape[1]])


model = TinyHunyuanVideo().eval()
lengths = [7, 2]
B, N, T = len(lengths), 12, 8
x = torch.randn(B, N, 6)
text_states = torch.randn(B, T, 10)
prompt_attention_mask = torch.zeros(B, T, dtype=torch.long)
for i, n in enumerate(lengths):
    prompt_attention_mask[i, :n] = 1
with torch.no_grad():
    out = model(x, text_states, prompt_attention_mask)
    alone = [model(x[i:i + 1], text_states[i:i + 1, :n], torch.ones(1, n, dtype=torch.long)) for i, n in enumerate(lengths)]
print("max |batched - one prompt alone| =", max((out[i] - a[0]).abs().max().item() for i, a in enumerate(alone)))
