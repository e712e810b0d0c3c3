"""A chat SFT step on a left-padded batch whose pad id is its EOS (0): the mask is `ids != pad`, which also masks the
EOS closing the first answer of a two-turn row, so the second turn never sees it though the loss (outside the model)
trains on it (--fixed: the mask from each row's length)."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
EOS = PAD = 0


class ChatLM(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(30, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, 30)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * (d // self.heads) ** -0.5
        keep = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        return self.head(x + torch.einsum("bhqk,bhkd->bqhd", scores.softmax(-1), v).reshape(b, n, d))


def collate(samples):
    width = max(len(ids) for ids, _ in samples)
    ids = torch.tensor([[PAD] * (width - len(i)) + i for i, _ in samples])
    labels = torch.tensor([[-100] * (width - len(i)) + l for i, l in samples])
    if FIXED:
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i, _ in samples])
    else:
        mask = (ids != PAD).long()
    return ids, mask, labels


if __name__ == "__main__":
    torch.manual_seed(0)
    two = ([5, 6, 7, 8, EOS, 5, 9, 7, 10, 11, EOS], [-100, -100, -100, 8, EOS, -100, -100, -100, 10, 11, EOS])
    one = ([5, 12, 7, 13, EOS], [-100, -100, -100, 13, EOS])
    ids, mask, labels = collate([two, one])
    logits = ChatLM()(ids, mask)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 30), labels[:, 1:].reshape(-1))
    print("loss", round(loss.item(), 4))
