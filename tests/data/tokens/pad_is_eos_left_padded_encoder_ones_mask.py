"""A sentence encoder whose config's pad id is its EOS id (1), handed a batch left-padded with it and
`torch.ones_like(input_ids)` (--fixed: the padding's own mask, 0 on the leading pads).

Written for maskcli's tests (checks/tokens.py's padding-unmarked where the pad id is also the EOS: each padded row's
pads one leading run, two long at least): a config object of the program's own, a bidirectional eager encoder, three
rows padded to 7 by 0, 4 and 2 pads, mean pooling.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
PAD = EOS = 1


class SentenceEncoder(nn.Module):
    def __init__(self, vocab=40, dim=8, heads=2):
        super().__init__()
        self.config = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS, hidden_size=dim)
        self.heads, self.embed, self.qkv = heads, nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)).masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)
        weights = attention_mask[:, :, None].float()
        return (out * weights).sum(1) / weights.sum(1)


def main():
    torch.manual_seed(0)
    sentences = [[5, 9, 12, 7, 20, 3, EOS], [8, 11, EOS], [14, 6, 30, 22, EOS]]
    width = max(map(len, sentences))
    ids = torch.tensor([[PAD] * (width - len(s)) + s for s in sentences])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sentences]) if FIXED else torch.ones_like(ids)
    with torch.no_grad():
        emb = SentenceEncoder()(ids, mask)
    print("fixed" if FIXED else "buggy", emb.shape)


if __name__ == "__main__":
    main()
