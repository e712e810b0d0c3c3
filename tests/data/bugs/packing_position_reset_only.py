"""DeepOpt-com/WrinkleFree-Monorepo#53: sequence packing reset the position ids at each document boundary, which only
changes RoPE, and attention stayed causal over the whole packed row: a document's tokens attended to the previous
document (changing it moved the next one's logits by up to 11.34). The fix adds a block-diagonal causal mask."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def compute_document_attention_mask(position_ids):
    doc = torch.cumsum(position_ids == 0, dim=-1)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return causal & (doc[:, :, None] == doc[:, None, :])


class Model(nn.Module):
    def __init__(self, vocab=16, dim=8, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, input_ids, position_ids, attention_mask=None):
        b, n = input_ids.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(self.embed(input_ids)).chunk(3, -1))
        if attention_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask[:, None])


torch.manual_seed(0)
input_ids = torch.tensor([[3, 4, 5, 2, 6, 7]])  # [A B C EOS] [D E]
position_ids = torch.tensor([[0, 1, 2, 3, 0, 1]])
with torch.no_grad():
    mask = compute_document_attention_mask(position_ids) if FIXED else None
    Model().eval()(input_ids, position_ids, attention_mask=mask)
