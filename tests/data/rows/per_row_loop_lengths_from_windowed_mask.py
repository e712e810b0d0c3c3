"""A padding-free attention written as a loop over batch rows, its heads on the loop's batch axis, whose sliding
layer takes each row's length from the last `window` columns of the padding mask.

Right-padded batch of two rows, 10 and 7 real tokens. Buggy: the sliding layer slices the mask to its window before
unpadding (`attention_mask[:, -window:]`), so its rows run over 4 and 1 tokens. Fixed: the lengths are the whole
mask's, and the window is applied inside each row's pass. The loss over the real tokens differs.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
WINDOW = 4


class Layer(nn.Module):
    def __init__(self, hidden=16, heads=2, window=None):
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x, attention_mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = attention_mask if FIXED or self.window is None else attention_mask[:, -self.window:]
        lengths = mask.sum(-1).tolist()
        y = torch.zeros_like(q)
        for row, length in enumerate(lengths):
            qs, ks, vs = (t[row, :, :length][:, None] for t in (q, k, v))  # (H, 1, n, d)
            scores = qs @ ks.transpose(-1, -2) / (d // self.heads) ** 0.5
            i = torch.arange(length)
            allowed = i[None, :] <= i[:, None]
            if self.window is not None:
                allowed &= i[None, :] > i[:, None] - self.window
            w = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            y[row, :, :length] = (w @ vs)[:, 0]
        return x + self.out(y.transpose(1, 2).reshape(b, n, d))


class Model(nn.Module):
    def __init__(self, vocab=40, hidden=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([Layer(hidden, window=WINDOW), Layer(hidden)])
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, attention_mask)
        return self.head(x)


def main():
    torch.manual_seed(0)
    model = Model()
    ids = torch.randint(1, 40, (2, 10))
    attention_mask = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])
    ids = ids.masked_fill(attention_mask == 0, 0)
    logits = model(ids, attention_mask)
    labels = ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 40), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    print(f"loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
