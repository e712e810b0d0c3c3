"""A correct greedy decode: the encoder is handed its source ids alone (its padding mask made inside, from the pad
id), and the decoder, called once per step over a fixed-width target whose undecoded slots hold the pad id, masks
those slots as padding beside its causal mask and hands the cross-attention the source's padding. At the first step
the decoder's self-attention keeps one key of its row (the start token) and hides the rest from every query, as a
padding mask does: it is the decoder's own, not the encoder's, and says nothing of the memory's padding. SDPA with bool masks (True = attend);
a batch of two sources of lengths 6 and 4, each row's decode checked against the row decoded alone."""

import torch
import torch.nn.functional as F
from torch import nn

PAD, START, WIDTH, D, HEADS = 0, 1, 6, 16, 2
torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x, memory, keep):
        b, lq, lk = x.shape[0], x.shape[1], memory.shape[1]
        q = self.q(x).view(b, lq, HEADS, -1).transpose(1, 2)
        k = self.k(memory).view(b, lk, HEADS, -1).transpose(1, 2)
        v = self.v(memory).view(b, lk, HEADS, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])
        return self.o(out.transpose(1, 2).reshape(b, lq, D))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, D)
        self.layers = nn.ModuleList(Attention() for _ in range(2))

    def forward(self, src):
        real = src != PAD
        keep = real[:, None, :].expand(-1, src.shape[1], -1)
        hidden = self.embed(src)
        for layer in self.layers:
            hidden = hidden + layer(hidden, hidden, keep)
        return hidden


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, D)
        self.selfs = nn.ModuleList(Attention() for _ in range(2))
        self.crosses = nn.ModuleList(Attention() for _ in range(2))
        self.out = nn.Linear(D, 12)

    def forward(self, tgt, memory, src):
        width = tgt.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        own = causal[None] & (tgt != PAD)[:, None, :]
        across = (src != PAD)[:, None, :].expand(-1, width, -1)
        hidden = self.embed(tgt)
        for attend, cross in zip(self.selfs, self.crosses):
            hidden = hidden + attend(hidden, hidden, own)
            hidden = hidden + cross(hidden, memory, across)
        return self.out(hidden)


def greedy(encoder, decoder, src):
    memory = encoder(src)
    tgt = torch.full((src.shape[0], WIDTH), PAD)
    tgt[:, 0] = START
    for step in range(WIDTH - 1):
        logits = decoder(tgt, memory, src)
        tgt[:, step + 1] = logits[:, step, 2:].argmax(-1) + 2  # (never the pad or start id)
    return tgt


encoder, decoder = Encoder().eval(), Decoder().eval()
src = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 3, PAD, PAD]])
with torch.no_grad():
    batch = greedy(encoder, decoder, src)
    alone = torch.cat([greedy(encoder, decoder, src[i:i + 1, :int((src[i] != PAD).sum())]) for i in range(2)])
assert torch.equal(batch, alone), (batch, alone)
print("decoded", batch.tolist())
