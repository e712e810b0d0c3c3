# Follows lifeiteng/vall-e valle/models/valle.py VALLE.forward (AR decoder): x_attn_mask = F.pad(zeros(x_len, x_len), (0, y_len),
# True) (text bidirectional, never sees audio), y_attn_mask = F.pad(triu(ones, 1), (x_len, 0), False) (audio: all text + causal),
# OR'ed with xy_padding_mask = cat([x_mask, y_mask]) (True = pad) so padding sits mid-sequence, then masked_fill(-inf) to a float mask.
import math
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, H = 32, 4


def make_pad_mask(lengths, max_len):
    return torch.arange(max_len)[None, :] >= lengths[:, None]  # True = pad


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ff = nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, D))
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, x, attn_mask):  # attn_mask [b*h, L, L] float, as torch MHA's 3-D mask
        b, L, _ = x.shape
        q, k, v = (t.view(b, L, H, -1).transpose(1, 2) for t in self.qkv(self.n1(x)).chunk(3, -1))
        s = q @ k.transpose(-1, -2) / math.sqrt(D // H) + attn_mask.view(b, H, -1, L)
        x = x + self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, L, D))
        return x + self.ff(self.n2(x))


layers = nn.ModuleList([Layer() for _ in range(2)]).eval()
x_lens, y_lens = torch.tensor([5, 2, 4]), torch.tensor([3, 6, 1])
bsz, x_len, y_len = 3, int(x_lens.max()), int(y_lens.max())
x = torch.randn(bsz, x_len, D)   # phoneme embeddings (+ sine pos), right padded
y = torch.randn(bsz, y_len, D)   # first-codebook audio embeddings (+ sine pos), right padded
with torch.no_grad():
    x_mask, y_mask = make_pad_mask(x_lens, x_len), make_pad_mask(y_lens, y_len)
    xy_padding_mask = torch.concat([x_mask, y_mask], dim=1)
    x_attn_mask = F.pad(torch.zeros((x_len, x_len), dtype=torch.bool), (0, y_len), value=True)
    y_attn_mask = F.pad(torch.triu(torch.ones(y_len, y_len, dtype=torch.bool), diagonal=1), (x_len, 0), value=False)
    xy_attn_mask = torch.concat([x_attn_mask, y_attn_mask], dim=0)
    src_len = x_len + y_len
    _xy_padding_mask = xy_padding_mask.view(bsz, 1, 1, src_len).expand(-1, H, -1, -1).reshape(bsz * H, 1, src_len)
    xy_attn_mask = xy_attn_mask.logical_or(_xy_padding_mask)
    new_attn_mask = torch.zeros_like(xy_attn_mask, dtype=x.dtype)
    new_attn_mask.masked_fill_(xy_attn_mask, float("-inf"))
    h = torch.concat([x, y], dim=1)
    for layer in layers:
        h = layer(h, new_attn_mask)
    # reference: each utterance alone with text and audio unpadded and adjacent, per-query explicit key lists
    diff = 0.0
    for b in range(bsz):
        xl, yl = int(x_lens[b]), int(y_lens[b])
        hb = torch.cat([x[b:b + 1, :xl], y[b:b + 1, :yl]], 1)
        for layer in layers:
            L = xl + yl
            q, k, v = (t.view(1, L, H, -1).transpose(1, 2) for t in layer.qkv(layer.n1(hb)).chunk(3, -1))
            rows = []
            for i in range(L):
                keys = list(range(xl)) if i < xl else list(range(i + 1))
                s = q[:, :, i:i + 1] @ k[:, :, keys].transpose(-1, -2) / math.sqrt(D // H)
                rows.append(s.softmax(-1) @ v[:, :, keys])
            hb = hb + layer.o(torch.cat(rows, 2).transpose(1, 2).reshape(1, L, D))
            hb = hb + layer.ff(layer.n2(hb))
        got = torch.cat([h[b:b + 1, :xl], h[b:b + 1, x_len:x_len + yl]], 1)
        diff = max(diff, (got - hb).abs().max().item())
print("max |mid-padded text+audio batch - each utterance alone| =", diff)
assert diff < 1e-10
