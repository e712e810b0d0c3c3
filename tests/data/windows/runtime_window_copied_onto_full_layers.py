# A hand-written serving loop in another project's style: the model's dataclass config lists each layer's type, and a
# runtime dict copies the model-wide window out of it. The buggy runtime hands that window to every layer whose own
# window is None (the full layer falls back to it); the fix gives the runtime no window once the layers are
# interleaved. A right-padded batch of two prompts, eager softmax over q @ k^T.
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class ModelArgs:
    dim: int = 16
    n_heads: int = 2
    n_layers: int = 3
    sliding_window: int = 3
    layer_types: list = field(default_factory=lambda: ["sliding_attention", "full_attention", "sliding_attention"])


args = ModelArgs()
runtime = {"sliding_window": None if FIXED else args.sliding_window}  # the engine's model-wide window


class Layer(nn.Module):
    def __init__(self, window):
        super().__init__()
        self.window = window if window is not None else runtime["sliding_window"]
        self.wqkv = nn.Linear(args.dim, 3 * args.dim, bias=False)

    def forward(self, x, pad):  # pad: (b, t) bool, True on a padding token
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, args.n_heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        i = torch.arange(t)
        allowed = i[None, :] <= i[:, None]
        if self.window is not None:
            allowed = allowed & (i[:, None] - i[None, :] < self.window)
        allowed = allowed[None, None] & ~pad[:, None, None, :]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.nan_to_num(scores.softmax(-1)) @ v
        return x + out.transpose(1, 2).reshape(b, t, -1)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            Layer(args.sliding_window if kind == "sliding_attention" else None) for kind in args.layer_types)

    def forward(self, x, pad):
        for layer in self.layers:
            x = layer(x, pad)
        return x


model = Model().eval()
x = torch.randn(2, 8, args.dim)
pad = torch.tensor([[False] * 8, [False] * 6 + [True] * 2])
with torch.no_grad():
    y = model(x, pad)
print(f"fixed={FIXED} out[0, -1, :3]={[round(v, 4) for v in y[0, -1, :3].tolist()]}")
