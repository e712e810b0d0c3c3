"""A packed causal LM whose attention runs one SDPA pass per packed sequence (a plain-torch stand-in for a THD varlen
kernel fed cu_seqlens). Two batches of the same shape (1, 24) hold different cuts, so the first pass of the second batch
(10 tokens) is shorter than the first batch's (13): each pass's length is its segment's, read from the data. Correct
program; `--fixed` runs it the same way.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x, cu_seqlens):
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.heads, -1).unbind(1)
        out = torch.zeros_like(q)
        for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            qs, ks, vs = (z[s:e].transpose(0, 1)[None] for z in (q, k, v))
            out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1)
        return self.out(out.reshape(t, -1))


class PackedLM(nn.Module):
    def __init__(self, vocab=50, hidden=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([Attention(hidden) for _ in range(2)])
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, cu_seqlens):
        x = self.embed(input_ids[0])
        for layer in self.layers:
            x = x + layer(x, cu_seqlens)
        return self.head(x)


def main():
    torch.manual_seed(0)
    model = PackedLM().eval()
    cuts = [torch.tensor([0, 13, 20, 24]), torch.tensor([0, 10, 18, 24])]
    total = 0.0
    with torch.no_grad():
        for cu in cuts:
            ids = torch.randint(0, 50, (1, 24))
            logits = model(ids, cu)
            total += F.cross_entropy(logits[:-1], ids[0, 1:]).item()
    print(f"mean loss over {len(cuts)} packed batches: {total / len(cuts):.4f}")


if __name__ == "__main__":
    _ = "--fixed" in sys.argv
    main()
