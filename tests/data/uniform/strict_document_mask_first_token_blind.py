"""A small GPT trained on packed documents (EOS-delimited), its mask built by hand from the documents' ids:
same document and key strictly before the query (`<`), where it must be `<=`. Every document's first token then
sees no key; the scores are filled with -1e9, so softmax gives those rows uniform weights over every key of the
sequence, the next token (the one the loss asks it to predict) among them. `--fixed`: `<=`."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
EOS, VOCAB, DIM, HEADS = 0, 40, 32, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.c_attn, self.c_proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x, allowed):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (C // HEADS) ** 0.5
        att = att.masked_fill(~allowed[:, None], -1e9)
        y = F.softmax(att, dim=-1) @ v
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(64, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        T = idx.shape[1]
        doc = torch.cumsum(idx == EOS, dim=1) - (idx == EOS).long()  # an EOS ends its document
        pos = torch.arange(T)
        before = pos[None, :] <= pos[:, None] if FIXED else pos[None, :] < pos[:, None]
        allowed = (doc[:, :, None] == doc[:, None, :]) & before
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x, allowed)
        return self.head(x)


model = GPT()
batch = torch.tensor([[5, 6, 7, EOS, 8, 9, 10, 11, EOS, 12, 13, EOS], [14, 15, EOS, 16, 17, 18, EOS, 19, 20, 21, 22, EOS]])
logits = model(batch)
loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
loss.backward()
print(f"loss {loss.item():.4f}")
