"""The chunk size in a dict local to main(), handed to a mask builder: --bug missing drops the chunks (plain causal),
--bug size cuts them one position too long (range(0, n, size + 1)); --fixed: chunks of attention_chunk_size."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
BUG = sys.argv[sys.argv.index("--bug") + 1] if "--bug" in sys.argv else "missing"


def chunked_mask(params, n):
    keep = torch.zeros(n, n, dtype=torch.bool)
    size = params["attention_chunk_size"]
    step = size if FIXED else (n if BUG == "missing" else size + 1)
    for start in range(0, n, step):
        for q in range(start, min(start + step, n)):
            keep[q, start:q + 1] = True
    return keep


class Net(torch.nn.Module):
    def __init__(self, params):
        super().__init__()
        self.mask = chunked_mask(params, 9)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(params["n_layers"]))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = x + F.scaled_dot_product_attention(block(x), x, x, attn_mask=self.mask)
        return x


def main():
    params = {"n_layers": 2, "attention_chunk_size": 4}
    net = Net(params)
    with torch.no_grad():
        net(torch.randn(1, 1, 9, 4))


main()
