"""huggingface/nanoVLM#204: packed samples got position_ids that restart at 0 for each sample, but the language model
kept SDPA's causal fast path, so sample B still attended to sample A inside the packed row. The fix builds a
document-aware mask from the packed sample ids."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class LanguageModel(nn.Module):
    def __init__(self, vocab=16, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rotary = nn.Embedding(32, dim)
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, input_ids, position_ids, document_ids=None):
        h = self.embed(input_ids) + self.rotary(position_ids)
        q, k, v = self.qkv(h).unsqueeze(1).chunk(3, dim=-1)
        if document_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        length = input_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        same = document_ids[:, :, None] == document_ids[:, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(causal & same)[:, None])


samples = [[1, 2, 3], [4, 5], [6, 7, 8]]
input_ids = torch.tensor([[t for s in samples for t in s]])
position_ids = torch.tensor([[i for s in samples for i in range(len(s))]])
document_ids = torch.tensor([[n for n, s in enumerate(samples) for _ in s]])
torch.manual_seed(0)
with torch.no_grad():
    LanguageModel().eval()(input_ids, position_ids, document_ids if FIXED else None)
