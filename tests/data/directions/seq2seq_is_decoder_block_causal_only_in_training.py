"""A hand-written seq2seq model whose blocks say which side they are (`self.is_decoder`, as T5's blocks do), scored
teacher-forced in eval mode over right-padded targets.

`make_causal_mask` sits beside the block; buggy: the block adds it only while training (`self.is_decoder and
self.training`), so in eval mode the decoder's self-attention (nn.MultiheadAttention, key_padding_mask from the pad
id) sees later target tokens. Fixed (`--fixed`): every decoder block applies it. Encoder blocks and the
cross-attention take the source's padding only.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


def make_causal_mask(n):
    """True = masked: keys after the query."""
    return torch.ones(n, n, dtype=torch.bool).triu(1)


class Block(nn.Module):
    def __init__(self, d, heads, is_decoder):
        super().__init__()
        self.is_decoder = is_decoder
        self.self_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        if is_decoder:
            self.cross_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, pad, memory=None, memory_pad=None):
        causal = self.is_decoder and (FIXED or self.training)
        mask = make_causal_mask(x.shape[1]) if causal else None
        x = x + self.self_attn(x, x, x, attn_mask=mask, key_padding_mask=pad, need_weights=False)[0]
        if self.is_decoder:
            x = x + self.cross_attn(x, memory, memory, key_padding_mask=memory_pad, need_weights=False)[0]
        return x + self.ff(x)


class Seq2Seq(nn.Module):
    def __init__(self, vocab=30, d=16, heads=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=PAD)
        self.encoder = nn.ModuleList([Block(d, heads, False) for _ in range(layers)])
        self.decoder = nn.ModuleList([Block(d, heads, True) for _ in range(layers)])
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, src, tgt):
        src_pad, tgt_pad = src == PAD, tgt == PAD
        memory = self.embed(src)
        for block in self.encoder:
            memory = block(memory, src_pad)
        x = self.embed(tgt)
        for block in self.decoder:
            x = block(x, tgt_pad, memory, src_pad)
        return self.lm_head(x)


model = Seq2Seq().eval()
src = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, PAD, PAD, PAD]])
tgt = torch.tensor([[1, 12, 13, 14, 15], [1, 16, 17, PAD, PAD]])
with torch.no_grad():
    logits = model(src, tgt)
    changed = tgt.clone()
    changed[0, 4] = 20
    moved = (model(src, changed)[0, 0] - logits[0, 0]).abs().max().item()
print(f"fixed={FIXED} target position 0 moves by {moved:.5f} when the last target token changes")
