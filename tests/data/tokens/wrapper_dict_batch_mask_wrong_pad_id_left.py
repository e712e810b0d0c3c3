"""A classifier wrapper handed a dict batch; its encoder builds the key padding mask from the wrong pad id.

Written for maskcli's tests (not a published bug): the second program padding-unmarked catches where the ids and the
mask are held by a function inside the model call, not given to it (the first: thunlp/FewRel#17's mask computed
after padding, tests/data/bugs). `Classifier.forward(batch)` holds a config with `pad_token_id=1` (RoBERTa's) and
calls `Encoder.forward(tokens)` with the left-padded ids; the encoder builds `mask = tokens != 0`, a pad id the
program never states, so every left pad is attended by the real tokens through SDPA's bool mask.
Fix (--fixed): `mask = tokens != self.pad_id`, the config's.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.pad_id = config.pad_token_id
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.heads = config.heads

    def forward(self, tokens):
        mask = tokens != (self.pad_id if FIXED else 0)
        b, n = tokens.shape
        q, k, v = self.qkv(self.embed(tokens)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return out.transpose(1, 2).reshape(b, n, -1)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(pad_token_id=1, vocab_size=40, dim=16, heads=2)
        self.encoder = Encoder(self.config)
        self.head = nn.Linear(16, 3)

    def forward(self, batch):
        hidden = self.encoder(batch["tokens"])
        return self.head(hidden[:, -1])  # the last token: the rows are left-padded


def main():
    torch.manual_seed(0)
    rows = [[5, 17, 9, 22], [8, 30, 12, 6, 19, 27, 2]]
    width = max(map(len, rows))
    batch = {"tokens": torch.tensor([[1] * (width - len(r)) + r for r in rows])}
    with torch.no_grad():
        logits = Classifier()(batch)
    print("fixed" if FIXED else "buggy", [round(x, 4) for x in logits[0].tolist()])


if __name__ == "__main__":
    main()
