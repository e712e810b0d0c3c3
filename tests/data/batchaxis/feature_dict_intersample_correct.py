# Correct: a CTR model handed a batch dict of features (one value per sample each, a left-padded behaviour history)
# whose attention calls keep each sample's tokens apart where they mean to, and mix the samples only where they mean
# to: AutoInt-style self-attention over the fields (as many fields as samples: (B, fields, dim), batch-first), the
# history through nn.TransformerEncoderLayer at batch_first=False handed (seq, batch, embed) as it reads it, and
# SAINT's intersample attention, which flattens each sample to one token ('b n d -> 1 b (n d)') and attends over the
# batch on purpose. No call's keys are the samples with batch rows made of a sample's fields.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
_ = "--fixed" in sys.argv  # (the same program either way)

BATCH, FIELDS, HIST, DIM, HEADS = 5, 5, 7, 8, 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.field_emb = nn.ModuleDict({f"f{i}": nn.Embedding(20, DIM) for i in range(FIELDS - 1)})
        self.item_emb = nn.Embedding(30, DIM, padding_idx=0)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.encoder = nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=16, dropout=0.0)
        self.inter = nn.Linear(FIELDS * DIM, 3 * FIELDS * DIM)
        self.out = nn.Linear(FIELDS * DIM, 1)

    def forward(self, x):
        fields = [self.field_emb[k](x[k]) for k in self.field_emb]
        hist = self.item_emb(x["hist"])  # (B, HIST, DIM), left-padded with 0
        hist = self.encoder(hist.transpose(0, 1), src_key_padding_mask=x["hist"] == 0).transpose(0, 1)
        tokens = torch.stack(fields + [hist[:, -1]], dim=1)  # (B, FIELDS, DIM)
        q, k, v = self.qkv(tokens).view(BATCH, FIELDS, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        tokens = tokens + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(BATCH, FIELDS, DIM)
        rows = tokens.reshape(1, BATCH, FIELDS * DIM)  # SAINT: one token per sample, attention across the batch
        q, k, v = self.inter(rows).view(1, BATCH, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        rows = rows + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, BATCH, -1)
        return self.out(rows[0]).squeeze(-1)


hist = torch.zeros(BATCH, HIST, dtype=torch.long)
for b, n in enumerate([7, 3, 5, 1, 6]):
    hist[b, HIST - n:] = torch.randint(1, 30, (n,))
x = {**{f"f{i}": torch.randint(0, 20, (BATCH,)) for i in range(FIELDS - 1)}, "hist": hist}
model = Net()
with torch.no_grad():
    print(round(float(model(x).sum()), 4))
