"""A seq2seq decoder that applies its future mask only on the incremental path, so teacher forcing sees ahead.

Written for checks/directions.py (decoder-mask-not-causal), another way than espnet#1539: fairseq-style
`buffered_future_mask` as a method of the decoder class (not a module function), nn.MultiheadAttention as the kernel
with a key_padding_mask (True = padding), targets right-padded (fairseq's left_pad_target=False: left-padded targets
under a future mask leave the pads' query rows no key, which MHA's fast path in eval mode fills with NaN, and the next
layer reads that NaN through every row of the sample). Buggy: `attn_mask` is built only when an incremental state is
given; the fix builds it whenever there is more than one target position.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.encoder_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ff = nn.Linear(dim, dim)

    def forward(self, x, memory, attn_mask, pad):
        x = x + self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=pad, need_weights=False)[0]
        x = x + self.encoder_attn(x, memory, memory, need_weights=False)[0]
        return x + self.ff(x)


class Seq2SeqDecoder(nn.Module):
    def __init__(self, vocab=40, dim=16, heads=2, layers=2, pad=0):
        super().__init__()
        self.pad = pad
        self.embed = nn.Embedding(vocab, dim, padding_idx=pad)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))

    def buffered_future_mask(self, x):
        n = x.size(1)
        return torch.ones(n, n, dtype=torch.bool).triu(1)  # True = not attended

    def forward(self, prev_output_tokens, memory, incremental_state=None):
        x = self.embed(prev_output_tokens)
        pad = prev_output_tokens.eq(self.pad)
        if FIXED:
            attn_mask = self.buffered_future_mask(x) if x.size(1) > 1 else None
        else:
            attn_mask = self.buffered_future_mask(x) if incremental_state is not None else None
        for layer in self.layers:
            x = layer(x, memory, attn_mask, pad)
        return x


if __name__ == "__main__":
    decoder = Seq2SeqDecoder().eval()
    memory = torch.randn(2, 7, 16)
    tokens = torch.tensor([[2, 11, 7, 5, 0, 0], [2, 9, 3, 14, 6, 8]])  # right-padded targets, <bos>=2 first
    changed = tokens.clone()
    changed[1, 5] = 30
    with torch.no_grad():
        a, b = decoder(tokens, memory), decoder(changed, memory)
    print("fixed" if FIXED else "buggy", "row 1 position 1 moves with its last token:",
          f"{(a[1, 1] - b[1, 1]).abs().max().item():.4f}")
