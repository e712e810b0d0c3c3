"""DALLE-pytorch 9bf1f0f's slip written another way: a hand-written causal LM is trained on a LEFT-padded batch with an
eager softmax whose mask is `causal & key_padding`, filled with -1e9. A pad query row at the start sees no key at all:
the finite fill gives it uniform weights over the whole row, the real tokens after it included. The training loop
builds its labels as the ids shifted by one and hands them to `F.cross_entropy` without ignoring the padding, so the
last pad row, whose target is the row's first real token, is trained on a prediction that attended that very token.
`--fixed` ignores (-100) the targets of the pad positions' predictions; the loss then equals the mean over each row's
own tokens, run alone, unpadded.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(16, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask):
        b, n = input_ids.shape
        positions = (attention_mask.cumsum(1) - 1).clamp(min=0)
        x = self.emb(input_ids) + self.pos(positions)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        keep = torch.ones(n, n, dtype=torch.bool).tril() & attention_mask.bool()[:, None, None, :]
        weights = scores.masked_fill(~keep, -1e9).softmax(-1)
        x = x + self.out((weights @ v).transpose(1, 2).reshape(b, n, -1))
        return self.head(x)


def loss_of(model, input_ids, attention_mask):
    logits = model(input_ids, attention_mask)
    labels = input_ids[:, 1:].clone()
    if FIXED:
        labels[attention_mask[:, :-1] == 0] = -100  # (a pad query's prediction: not trained)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1))


def main():
    model = TinyLM()
    rows = [[5, 9, 3, 7, 1, 8, 2], [12, 4, 8, 30], [3, 17, 21, 9, 6]]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), PAD)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row):] = torch.tensor(row)
        attention_mask[i, width - len(row):] = 1
    loss = loss_of(model, input_ids, attention_mask)
    loss.backward()
    with torch.no_grad():
        sums = [F.cross_entropy(model(torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))[0, :-1],
                                torch.tensor(r[1:]), reduction="sum") for r in rows]
        alone = sum(sums) / sum(len(r) - 1 for r in rows)
    print("loss", round(loss.item(), 5), "over the rows alone", round(alone.item(), 5))
    if FIXED:
        assert torch.allclose(loss, alone, atol=1e-5)


if __name__ == "__main__":
    main()
