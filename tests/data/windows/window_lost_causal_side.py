"""A sliding-window decoder configured by a dict at the top of the program; its mask keeps the keys at most W - 1
before each query but forgets the causal side, so every later key is seen (python FILE; --fixed: both bounds)."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv

hf_config = {"hidden_size": 16, "num_attention_heads": 2, "sliding_window": 3}


class WindowAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.window = config["sliding_window"]
        self.heads = config["num_attention_heads"]
        self.qkv = nn.Linear(config["hidden_size"], 3 * config["hidden_size"])

    def forward(self, x, pad):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        allowed = j > i - self.window  # the W - 1 keys before the query (and itself)
        if FIXED:
            allowed = allowed & (j <= i)
        allowed = allowed[None, None] & pad[:, None, None, :].bool()
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)


def main():
    torch.manual_seed(0)
    layer = WindowAttention(hf_config)
    x = torch.randn(2, 8, 16)
    pad = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])  # row 1 right-padded
    with torch.no_grad():
        out = layer(x, pad)
    print("out[0,0,:3] =", [round(v, 4) for v in out[0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
