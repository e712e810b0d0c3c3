"""A BERT-like encoder handed a right-padded batch: the padding mask given to SDPA as True = pad (SDPA keeps True)."""
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Encoder(nn.Module):
    def __init__(self, d=8, heads=2):
        super().__init__()
        self.emb = nn.Embedding(30, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.h = heads

    def forward(self, input_ids, attention_mask):
        x = self.emb(input_ids)
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        pad = attention_mask == 0  # True where padding
        mask = ~pad if FIXED else pad
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])


torch.manual_seed(0)
ids = torch.tensor([[3, 4, 5, 0, 0], [6, 7, 8, 9, 10], [1, 2, 0, 0, 0]])
Encoder()(ids, (ids != 0).long())
