"""Alternating local/global layers (Gemma-2 style, hand-written): every layer's attend() is handed window_size=(3, 0);
the global layers pass use_window=False and attend causally over every earlier key (correct)."""
import torch
import torch.nn.functional as F
from torch import nn


def attend(q, k, v, window_size=(3, 0), use_window=True):
    t = q.shape[-2]
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    mask = j <= i
    if use_window:
        mask = mask & (j > i - window_size[0] - 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Layer(nn.Module):
    def __init__(self, idx, d=16, h=2):
        super().__init__()
        self.h = h
        self.local = idx % 2 == 0
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        return x + attend(q, k, v, window_size=(3, 0), use_window=self.local).transpose(1, 2).reshape(b, t, d)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer(i) for i in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def main():
    torch.manual_seed(0)
    with torch.no_grad():
        out = Model().eval()(torch.randn(1, 8, 16))
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
