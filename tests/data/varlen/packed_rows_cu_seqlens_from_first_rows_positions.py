# The bug of huggingface/nanotron#341 (cu_seqlens built of the 2-D position_ids' row indices, so the varlen kernel ran
# across packed documents), written another way: a packed pretraining decoder whose forward takes (B, S) position_ids
# that restart at 0 at each document, and builds the cu_seqlens it hands each layer by keyword from the FIRST row's
# document starts, offset for every row (as if all rows were packed alike); its varlen attention is a plain loop over
# the documents. `--fixed` takes the starts of the flattened position_ids.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def varlen_attention(q, k, v, cu_seqlens):
    """q, k, v: (T, H, D) packed tokens; each document [cu[i], cu[i + 1]) attends itself, causally."""
    out = torch.zeros_like(q)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        if end > start:
            qi, ki, vi = (t[start:end].transpose(0, 1) for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).transpose(0, 1)
    return out


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden, cu_seqlens=None):
        tokens, dim = hidden.shape
        q, k, v = self.qkv(hidden).view(tokens, 3, self.heads, dim // self.heads).unbind(1)
        return hidden + self.proj(varlen_attention(q, k, v, cu_seqlens).reshape(tokens, dim))


class PackedDecoder(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16, heads: int = 2, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids):
        batch, seq = position_ids.shape
        if FIXED:
            starts = torch.nonzero(position_ids.flatten() == 0).flatten()
        else:
            first = torch.nonzero(position_ids[0] == 0).flatten()
            starts = (first[None, :] + seq * torch.arange(batch)[:, None]).flatten()
        cu_seqlens = torch.cat([starts, torch.tensor([batch * seq])]).to(torch.int32)
        hidden = self.embed(input_ids.flatten())
        for layer in self.layers:
            hidden = layer(hidden, cu_seqlens=cu_seqlens)
        return self.head(hidden).view(batch, seq, -1)


documents = [[[3, 8, 9, 4, 11], [6, 7, 2]], [[5, 12], [14, 15, 16, 17, 18, 19]]]  # two rows of 8 packed tokens
input_ids = torch.tensor([[t for doc in row for t in doc] for row in documents])
position_ids = torch.tensor([[p for doc in row for p in range(len(doc))] for row in documents])
model = PackedDecoder()
logits = model(input_ids, position_ids)
loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))
print("loss:", round(loss.item(), 5))
