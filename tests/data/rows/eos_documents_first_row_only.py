"""Pretraining on EOS-packed rows with a document mask (nanoGPT-style model): the document ids made from the first
row's EOS only, so the second row's documents leak into each other (--fixed: each row's own)."""
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
EOS = 1


class GPT(nn.Module):
    eos_id = EOS

    def __init__(self, d=8):
        super().__init__()
        self.wte = nn.Embedding(16, d)
        self.attn = nn.Linear(d, 3 * d)

    def forward(self, idx):
        doc = torch.cumsum(idx == self.eos_id, dim=1)
        doc = torch.cat([torch.zeros_like(doc[:, :1]), doc[:, :-1]], 1)  # the EOS ends its document
        if not FIXED:
            doc = doc[:1].expand_as(doc)
        t = idx.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = causal & (doc[:, :, None] == doc[:, None, :])
        q, k, v = self.attn(self.wte(idx)).unsqueeze(1).chunk(3, -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


torch.manual_seed(0)
GPT()(torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, 3], [4, 4, 4, 4, EOS, 6, 7, 8]]))
