"""A sentence classifier whose pooled vector is a plain mean over every position of a padded batch.

`Classifier.forward(ids, attention_mask)`: an embedding (padding_idx 0), one nn.MultiheadAttention layer (batch_first)
handed `key_padding_mask = attention_mask == 0`, a residual and a feed-forward, then `h.mean(dim=1)` over all the
batch's positions, the pads' rows among them (nothing zeroes them). The batch is right-padded to 7 (lengths 7, 4, 2).
`--fixed` pools `(h * mask).sum(1) / mask.sum(1)`.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(2)


class Classifier(nn.Module):
    def __init__(self, vocab=30, width=16, heads=2, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
        self.out = nn.Linear(width, classes)

    def forward(self, ids, attention_mask):
        x = self.embed(ids)
        a, _ = self.attn(x, x, x, key_padding_mask=attention_mask == 0, need_weights=False)
        h = x + a
        h = h + self.ff(h)
        if FIXED:
            mask = attention_mask.unsqueeze(-1).float()
            pooled = (h * mask).sum(1) / mask.sum(1)
        else:
            pooled = h.mean(dim=1)
        return self.out(pooled)


def main():
    model = Classifier().eval()
    lengths = [7, 4, 2]
    ids = torch.zeros(3, 7, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(1, 30, (n,))
    mask = (ids != 0).long()
    with torch.no_grad():
        print("logits", [round(v, 4) for v in model(ids, mask).flatten().tolist()])


main()
