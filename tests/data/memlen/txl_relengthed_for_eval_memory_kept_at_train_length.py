"""A Transformer-XL-style language model trained with a memory of one segment, then re-lengthed for evaluation.

As NVIDIA's Transformer-XL does (`reset_length`, written blind as quiet-r128a), the model trains with `mem_len` equal
to the segment (16) and evaluates with a longer memory (`reset_length(mem_len=40)`): each phase keeps the memory its
`self.mem_len` says as it runs. The buggy update keeps the training length it copied at construction
(`self.trained_length`, a count of its own), so the evaluation's memory never grows past one segment where the model now states 40. The fix
keeps `self.mem_len`."""
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
    def __init__(self, vocab=64, width=32, layers=2, mem_len=16):
        super().__init__()
        self.mem_len = self.trained_length = mem_len
        self.embed, self.layers = nn.Embedding(vocab, width), nn.ModuleList(Layer(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def reset_length(self, mem_len):
        self.mem_len = mem_len

    def init_mems(self, batch):
        return [torch.zeros(batch, 0, self.embed.embedding_dim) for _ in self.layers]

    def _update_mems(self, hids, mems, qlen):
        with torch.no_grad():
            keep = self.mem_len if FIXED else self.trained_length
            return [torch.cat([m, h], dim=1)[:, -keep:].detach() for h, m in zip(hids, mems)]

    def forward(self, tokens, mems=None):
        mems = self.init_mems(tokens.shape[0]) if mems is None else mems
        h, hids = self.embed(tokens), []
        for layer, mem in zip(self.layers, mems):
            hids.append(h)
            h = layer(h, mem)
        return self.head(h), self._update_mems(hids, mems, tokens.shape[1])


def main():
    torch.manual_seed(0)
    model = MemoryLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    text = torch.randint(0, 64, (2, 81))
    mems = None
    for start in range(0, 64, 16):  # training: a memory of one segment
        logits, mems = model(text[:, start:start + 16], mems)
        loss = F.cross_entropy(logits.reshape(-1, 64), text[:, start + 1:start + 17].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.reset_length(mem_len=40)
    model.eval()
    mems, total = None, 0.0
    with torch.no_grad():
        for start in range(0, 80, 16):
            logits, mems = model(text[:, start:start + 16], mems)
            total += logits.logsumexp(-1).mean().item()
    print(f"fixed={FIXED} memory={mems[0].shape[1]} total={total:.4f}")


if __name__ == "__main__":
    main()
