"""A hand-written RoBERTa-style encoder (fairseq's LearnedPositionalEmbedding: an nn.Embedding whose padding_idx row is
the padding's position) pretrained on packed rows: two documents per row, right-padded with the pad id, a
block-diagonal mask per row through SDPA. The packing numbers each document's positions itself and hands them to the
model. Buggy: every document restarts at 0, so its second token reads the padding row (padding_idx = 1) and its
first a row the model never numbers. Fixed (`--fixed`): each document counts from padding_idx + 1, as the model's own
numbering (`utils.make_positions`) does.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
PAD, DIM, HEADS = 1, 16, 2


class LearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, padding_idx):
        super().__init__(num_embeddings + padding_idx + 1, embedding_dim, padding_idx)

    def forward(self, input, positions=None):
        if positions is None:  # fairseq's make_positions: real tokens from padding_idx + 1, pads at padding_idx
            keep = input.ne(self.padding_idx).int()
            positions = (torch.cumsum(keep, dim=1) * keep).long() + self.padding_idx
        return super().forward(positions)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.ln = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM), nn.LayerNorm(DIM)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, HEADS, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.ln(x + self.out(y.transpose(1, 2).reshape(b, t, DIM)))


class Encoder(nn.Module):
    def __init__(self, vocab=40):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, DIM, padding_idx=PAD)
        self.embed_positions = LearnedPositionalEmbedding(32, DIM, PAD)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.lm_head = nn.Linear(DIM, vocab)

    def forward(self, tokens, position_ids=None, document_ids=None, attention_mask=None):
        x = self.embed_tokens(tokens) + self.embed_positions(tokens, position_ids)
        same = document_ids[:, :, None] == document_ids[:, None, :]
        mask = same & attention_mask.bool()[:, None, :]
        mask = mask | torch.eye(tokens.shape[1], dtype=torch.bool)[None]  # (a pad query keeps itself: no NaN row)
        for layer in self.layers:
            x = layer(x, mask)
        return self.lm_head(x)


def pack(documents, length):
    """One row of whole documents, right-padded: ids, each token's position, its document, the attention_mask."""
    ids, positions, docs = [], [], []
    for d, doc in enumerate(documents):
        start = PAD + 1 if FIXED else 0
        ids += doc
        positions += [start + i for i in range(len(doc))]
        docs += [d] * len(doc)
    pad = length - len(ids)
    return ids + [PAD] * pad, positions + [PAD] * pad, docs + [-1] * pad, [1] * len(ids) + [0] * pad


torch.manual_seed(0)
model = Encoder()
rows = [pack([[5, 6, 7, 8], [9, 10, 11]], 9), pack([[12, 13, 14, 15, 16], [17, 18]], 9)]
tokens, positions, documents, attention = (torch.tensor([row[i] for row in rows]) for i in range(4))
logits = model(tokens, position_ids=positions, document_ids=documents, attention_mask=attention)
labels = tokens.masked_fill(attention == 0, -100)
loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
print(f"loss {loss.item():.4f}; positions {positions.tolist()}")
