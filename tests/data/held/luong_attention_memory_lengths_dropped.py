"""A GRU seq2seq whose Luong ("general") attention over the encoder memory is never given the source lengths.

Written for maskcli's tests (checks/held.py, padding-unused), the OpenNMT-py#486 bug written another way: batch-major,
additive scores, `F.softmax` over a (B, S) score table, the source lengths named `src_lens`. `Seq2Seq.forward` holds
the batch's lengths, but `Decoder.forward` calls `self.attention(hidden, memory)` without `memory_mask`, so each step
of the shorter source attends its padded encoder states. `--fixed` builds the mask from `src_lens` and passes it.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class GeneralAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w_query = nn.Linear(dim, dim, bias=False)

    def forward(self, query, memory, memory_mask=None):
        scores = torch.bmm(self.w_query(query)[:, None, :], memory.transpose(1, 2))  # (B, 1, S)
        if memory_mask is not None:
            scores = scores.masked_fill(~memory_mask[:, None, :], float("-inf"))
        weights = F.softmax(scores, dim=-1)
        return torch.bmm(weights, memory).squeeze(1)


class Decoder(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.cell = nn.GRUCell(2 * dim, dim)
        self.attention = GeneralAttention(dim)

    def forward(self, tgt, memory, hidden, memory_mask=None):
        outputs = []
        for t in range(tgt.shape[1]):
            context = self.attention(hidden, memory, memory_mask=memory_mask)
            hidden = self.cell(torch.cat([self.embed(tgt[:, t]), context], dim=-1), hidden)
            outputs.append(hidden)
        return torch.stack(outputs, dim=1)


class Seq2Seq(nn.Module):
    def __init__(self, vocab=20, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.GRU(dim, dim, batch_first=True)
        self.decoder = Decoder(vocab, dim)

    def forward(self, src, src_lens, tgt):
        memory, last = self.encoder(self.embed(src))
        if FIXED:
            memory_mask = torch.arange(src.shape[1])[None, :] < src_lens[:, None]
            return self.decoder(tgt, memory, last[0], memory_mask=memory_mask)
        return self.decoder(tgt, memory, last[0])


if __name__ == "__main__":
    torch.manual_seed(0)
    src = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 0, 0, 0], [12, 13, 14, 15, 0, 0]])
    src_lens = torch.tensor([6, 3, 4])
    tgt = torch.tensor([[1, 2, 3], [1, 4, 5], [1, 6, 7]])
    with torch.no_grad():
        out = Seq2Seq().eval()(src, src_lens, tgt)
    print("fixed" if FIXED else "buggy", tuple(out.shape))
