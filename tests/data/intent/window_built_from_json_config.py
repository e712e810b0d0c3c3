"""A model built for a kernel from a checkpoint's config.json kept as text at the top of the program: the config says
sliding_window = 3 (keys a query sees, itself included); the builder hands the kernel spec window_size=(3, 0), which a
kernel taking FlashAttention's inclusive bounds reads as 4 keys (--fixed: (sliding_window - 1, 0)). The model's own
spec states causal and a (left, right) window only; the window the model was built from is the config's. Left-padded
batch, eager softmax."""
import json
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
CONFIG_JSON = '{"model_type": "mistral", "hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 2, "sliding_window": 3}'


@dataclass
class KernelSpec:
    causal: bool
    window_size: tuple
    heads: int


def build_spec(hf: dict) -> KernelSpec:
    left = hf["sliding_window"] - 1 if FIXED else hf["sliding_window"]
    return KernelSpec(causal=True, window_size=(left, 0), heads=hf["num_attention_heads"])


class Block(nn.Module):
    def __init__(self, spec: KernelSpec, dim: int):
        super().__init__()
        self.spec = spec
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, attention_mask):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.spec.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        keep = (j <= i) & (j >= i - self.spec.window_size[0]) & attention_mask.bool()[:, None, None, :]
        scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~keep, torch.finfo(q.dtype).min)
        return x + (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, d)


def main():
    torch.manual_seed(0)
    hf = json.loads(CONFIG_JSON)
    spec = build_spec(hf)
    blocks = nn.ModuleList(Block(spec, hf["hidden_size"]) for _ in range(hf["num_hidden_layers"])).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9]])
    x = nn.Embedding(12, hf["hidden_size"])(ids)
    with torch.no_grad():
        for block in blocks:
            x = block(x, (ids != 0).long())
    print(tuple(x.shape), "%.4f" % x.sum().item())


if __name__ == "__main__":
    main()
