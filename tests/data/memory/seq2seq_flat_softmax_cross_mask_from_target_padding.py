# The bug of jadore801120/attention-is-all-you-need-pytorch 94aae68 (the decoder's attention over the encoder masked
# by the TARGET's padding: `get_attn_padding_mask(src_seq, tgt_seq)` laid the target's pads on the source axis),
# written another way: a translation model whose attention softmaxes its scores as a 2-D view
# (`F.softmax(scores.view(-1, keys), dim=-1)`), its cross-attention a module of its own handed the memory, the source
# and the target padded to one length. `--fixed` masks the memory by the source's padding.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
PAD = 0
torch.manual_seed(0)


def attend(q, k, v, pad_keys):
    """q (B, Lq, D), k, v (B, Lk, D); pad_keys (B, Lk) True where a key is padding."""
    scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(pad_keys[:, None, :], float("-inf"))
    weights = F.softmax(scores.view(-1, scores.size(-1)), dim=-1).view_as(scores)
    return weights @ v


class Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, query, key, value, pad_keys):
        return attend(self.q(query), self.k(key), self.v(value), pad_keys)


class Translator(nn.Module):
    def __init__(self, vocab: int = 30, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.encoder = Attention(dim)
        self.memory_reader = Attention(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, src, tgt):
        src_pads, tgt_pads = src.eq(PAD), tgt.eq(PAD)
        memory = self.embed(src) + self.encoder(self.embed(src), self.embed(src), self.embed(src), src_pads)
        x = self.embed(tgt)
        x = x + self.memory_reader(x, memory, memory, src_pads if FIXED else tgt_pads)
        return self.out(x)


pairs = [([4, 9, 11, 7, 2], [5, 3, 8]), ([6, 13, 2], [12, 14, 15, 16, 17]), ([21, 22, 23, 24, 25], [18, 19, 20, 26])]
width = max(max(len(s), len(t)) for s, t in pairs)
src = torch.tensor([s + [PAD] * (width - len(s)) for s, _ in pairs])
tgt = torch.tensor([t + [PAD] * (width - len(t)) for _, t in pairs])
model = Translator()
logits = model(src, tgt)
loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=PAD)
print("loss:", round(loss.item(), 5))
