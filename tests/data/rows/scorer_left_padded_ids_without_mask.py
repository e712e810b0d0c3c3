"""A scorer object that keeps its tokenizer (pad id 3, left padding) and its causal LM, and scores a left-padded batch
by calling the model with the ids alone: the eager causal softmax lets every real token of a shorter row attend the
pad tokens before it (--fixed: the batch's attention_mask is handed on and masks the padding keys)."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class Vocab:
    pad_token_id = 3
    eos_token_id = 4
    padding_side = "left"

    def batch(self, rows):
        width = max(len(r) for r in rows)
        ids = torch.tensor([[self.pad_token_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return ids, mask


class TinyLM(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(40, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, 40)

    def forward(self, input_ids, attention_mask=None):
        x = self.embed(input_ids)
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5
        hide = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
        if attention_mask is not None:
            hide = hide | (attention_mask == 0)[:, None, None, :]
        scores = scores.masked_fill(hide, torch.finfo(scores.dtype).min)
        return self.head(x + (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class Scorer:
    def __init__(self):
        self.tokenizer = Vocab()
        self.model = TinyLM().eval()

    def score(self, rows):
        ids, mask = self.tokenizer.batch(rows)
        with torch.no_grad():
            logits = self.model(ids, attention_mask=mask) if FIXED else self.model(ids)
        return logits.log_softmax(-1)[:, -1].max(-1).values


if __name__ == "__main__":
    torch.manual_seed(0)
    print("scores", Scorer().score([[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]).tolist())
