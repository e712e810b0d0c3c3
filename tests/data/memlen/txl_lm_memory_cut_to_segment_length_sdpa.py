"""A Transformer-XL-style language model read segment by segment (batch first, SDPA with a boolean mask), each layer
attending [memory | segment] with the memory its module keeps (`self.mem_len = 48`, three segments of 16). The buggy
update keeps the last `qlen` hidden states (the segment's length) instead of the last `self.mem_len`, so the memory
never holds more than one segment. The fix keeps `self.mem_len`."""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Layer(nn.Module):
    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads, self.q, self.kv, self.out = heads, nn.Linear(width, width), nn.Linear(width, 2 * width), nn.Linear(width, width)

    def forward(self, h, mem):
        b, n, w = h.shape
        both = torch.cat([mem, h], dim=1)
        q = self.q(h).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(both).view(b, both.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        m = mem.shape[1]
        keep = torch.ones(n, m + n, dtype=torch.bool).tril(diagonal=m)  # the memory, then causal over the segment
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return h + self.out(y.transpose(1, 2).reshape(b, n, w))


class MemoryLM(nn.Module):
    def __init__(self, vocab=64, width=32, layers=2, mem_len=48):
        super().__init__()
        self.mem_len = mem_len
        self.embed, self.layers = nn.Embedding(vocab, width), nn.ModuleList(Layer(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def init_mems(self, batch):
        return [torch.zeros(batch, 0, self.embed.embedding_dim) for _ in self.layers]

    def _update_mems(self, hids, mems, qlen):
        with torch.no_grad():
            keep = self.mem_len if FIXED else qlen
            return [torch.cat([m, h], dim=1)[:, -keep:].detach() for h, m in zip(hids, mems)]

    def forward(self, tokens, mems=None):
        mems = self.init_mems(tokens.shape[0]) if mems is None else mems
        h, hids = self.embed(tokens), []
        for layer, mem in zip(self.layers, mems):
            hids.append(h)
            h = layer(h, mem)
        return self.head(h), self._update_mems(hids, mems, tokens.shape[1])


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = MemoryLM().eval()
    text = torch.randint(0, 64, (2, 80))
    mems, total = None, 0.0
    for start in range(0, 80, 16):
        logits, mems = model(text[:, start:start + 16], mems)
        total += logits.logsumexp(-1).mean().item()
    print(f"fixed={FIXED} memory={mems[0].shape[1]} total={total:.4f}")


if __name__ == "__main__":
    main()
