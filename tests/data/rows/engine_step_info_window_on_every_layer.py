"""A small serving loop whose per-step info object carries the window every layer then applies.

The model's config (a dict kept as `model_config`) lists its layers' kinds: layer 0 slides over 3 keys, layer 1 is
full. The engine builds one `StepInfo` per step for the whole batch, holding the sliding window of the model (the
largest any layer uses) and whether the step is causal. Buggy: each layer masks with `info.sliding_window`, so the
full layer slides too. Fixed: each layer masks with its own window (None on the full layer).
"""

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv

model_config = {"hidden": 16, "heads": 2, "vocab": 40, "sliding_window": 3,
                "layer_types": ["sliding_attention", "full_attention"]}


@dataclass
class StepInfo:
    sliding_window: int | None
    causal: bool
    start: int


def window_mask(q_len, k_len, start, window):
    q = torch.arange(start, start + q_len)[:, None]
    k = torch.arange(k_len)[None, :]
    keep = k <= q
    if window is not None:
        keep &= k > q - window
    return keep


class Layer(nn.Module):
    def __init__(self, cfg, kind):
        super().__init__()
        self.heads = cfg["heads"]
        self.window = cfg["sliding_window"] if kind == "sliding_attention" else None
        self.qkv = nn.Linear(cfg["hidden"], 3 * cfg["hidden"])
        self.out = nn.Linear(cfg["hidden"], cfg["hidden"])
        self.cache = None

    def forward(self, x, info):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if info.start:
            k, v = torch.cat([self.cache[0], k], 2), torch.cat([self.cache[1], v], 2)
        self.cache = (k, v)
        window = self.window if FIXED else info.sliding_window
        mask = window_mask(n, k.shape[2], info.start, window)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(y.transpose(1, 2).reshape(b, n, d))


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.layers = nn.ModuleList([Layer(cfg, kind) for kind in cfg["layer_types"]])
        self.head = nn.Linear(cfg["hidden"], cfg["vocab"])

    def forward(self, ids, info):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, info)
        return self.head(x)


def main():
    torch.manual_seed(0)
    model = Model(model_config).eval()
    windows = [w for w, kind in zip([model_config["sliding_window"]] * 2, model_config["layer_types"])
               if kind == "sliding_attention"]
    ids = torch.tensor([[3, 9, 4, 17, 22, 8, 5]])
    out, start = [], 0
    with torch.no_grad():
        for _ in range(4):
            info = StepInfo(sliding_window=max(windows), causal=True, start=start)
            logits = model(ids, info)
            start += ids.shape[1]
            ids = logits[:, -1:].argmax(-1)
            out.append(int(ids))
    print("generated", out)


if __name__ == "__main__":
    main()
