"""A language model trained on a collator's (B, L, L) keep mask (True = may attend: causal and the row's real
tokens), its inputs the tokens without their last one: the step narrows the mask with its rows one token on from its
columns, so each query is given the next token's row and sees the token it is trained to predict.

Written another way from EasyTPP 2c4ce4e (THP's `attention_mask[:, 1:, :-1]` over a True = masked mask): here a
True = keep mask from the collator, right-padded rows, `narrow` along each axis, a head axis added, and SDPA. The fix
narrows rows and columns alike (both from token 0).
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
VOCAB, D, HEADS, PAD = 30, 16, 2, 0


def collate(samples: list[list[int]]) -> dict:
    width = max(map(len, samples))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in samples])
    real = ids != PAD
    keep = torch.ones(width, width, dtype=torch.bool).tril()[None] & real[:, None, :] & real[:, :, None]
    keep |= torch.eye(width, dtype=torch.bool)[None]  # (a padding token sees itself: no empty row)
    return {"input_ids": ids, "attention_mask": keep}


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.qkv, self.out, self.head = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.Linear(D, VOCAB)

    def forward(self, ids, attn_mask):
        b, n = ids.shape
        x = self.embed(ids)
        q, k, v = (t.view(b, n, HEADS, D // HEADS).transpose(1, 2) for t in self.qkv(x).split(D, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.head(x + self.out(y.transpose(1, 2).reshape(b, n, D)))


def train_step(model, batch):
    ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    n = ids.shape[1] - 1
    rows = 0 if FIXED else 1
    attn_mask = attention_mask.narrow(1, rows, n).narrow(2, 0, n).unsqueeze(1)
    logits = model(ids[:, :n], attn_mask)
    targets = ids[:, 1:].masked_fill(ids[:, 1:] == PAD, -100)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)


torch.manual_seed(0)
model = LM()
batch = collate([[3, 7, 11, 5, 9, 14], [8, 2, 19, 4]])
loss = train_step(model, batch)
loss.backward()
print(f"loss {loss.item():.4f}")
