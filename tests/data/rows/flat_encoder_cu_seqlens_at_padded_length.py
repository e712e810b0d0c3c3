"""A sentence encoder that runs its batch flattened (THD) through a block-diagonal attention built from cu_seqlens.

Buggy: the collator flattens the padded (B, L) batch and sets cu_seqlens = [0, L, 2L, ...], every row counted at its
padded length, so each sentence's real tokens attend its pad tokens (the encoder is bidirectional). Fixed: the real
tokens are gathered first (the attention_mask's 1s) and cu_seqlens is the cumulative sum of the real lengths.
The sentence embeddings of the buggy run change with how much a row was padded. With `--causal` the layers are
causal: the pads of a right-padded row come after its real tokens, so no real token attends one either way.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
CAUSAL = "--causal" in sys.argv
PAD = 0


def block_diagonal(cu_seqlens, total):
    doc = torch.searchsorted(cu_seqlens[1:], torch.arange(total), right=True)
    same = doc[:, None] == doc[None, :]
    return same & torch.ones(total, total, dtype=torch.bool).tril() if CAUSAL else same


class Layer(nn.Module):
    def __init__(self, hidden=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x, cu_seqlens):
        t = x.shape[0]
        q, k, v = self.qkv(self.norm(x)).view(t, 3, self.heads, -1).permute(1, 2, 0, 3)
        mask = block_diagonal(cu_seqlens, t)
        y = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
        return x + self.out(y.transpose(0, 1).reshape(t, -1))


class FlatEncoder(nn.Module):
    def __init__(self, vocab=40, hidden=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, padding_idx=PAD)
        self.layers = nn.ModuleList([Layer(hidden) for _ in range(2)])

    def forward(self, input_ids, attention_mask, cu_seqlens):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return x


def collate(sentences):
    length = max(len(s) for s in sentences)
    ids = torch.tensor([s + [PAD] * (length - len(s)) for s in sentences])
    mask = (ids != PAD).long()
    if FIXED:
        keep = mask.reshape(-1).bool()
        lengths = mask.sum(dim=1)
        cu = F.pad(torch.cumsum(lengths, 0), (1, 0))
        return ids.reshape(-1)[keep], mask.reshape(-1)[keep], cu, lengths
    cu = torch.arange(0, ids.numel() + 1, length)
    return ids.reshape(-1), mask.reshape(-1), cu, mask.sum(dim=1)


def main():
    torch.manual_seed(0)
    model = FlatEncoder().eval()
    sentences = [[5, 9, 12, 7, 3, 8], [4, 11, 6], [13, 2, 10, 14]]
    ids, mask, cu, lengths = collate(sentences)
    with torch.no_grad():
        hidden = model(ids, mask, cu)
    if FIXED:
        pooled = [hidden[s:e].mean(0) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    else:
        width = hidden.shape[0] // len(sentences)
        pooled = [hidden[i * width:i * width + n].mean(0) for i, n in enumerate(lengths.tolist())]
    for s, p in zip(sentences, pooled):
        print(len(s), [round(v, 4) for v in p[:3].tolist()])


if __name__ == "__main__":
    main()
