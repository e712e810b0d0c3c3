"""A left-padded batch-first encoder step: the training step builds the batch's key padding mask (True = padding) for
pooling, then calls the encoder without it, so every token attends the left padding. --fixed hands it on.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class Encoder(nn.Module):
    def __init__(self, vocab=30, width=16, heads=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)

    def forward(self, tokens, key_padding_mask=None):
        x = self.embed(tokens)
        out, _ = self.attn(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)
        return out


def step(encoder, tokens, pad_id=0):
    padding_mask = tokens == pad_id  # left padding, True = padding
    hidden = encoder(tokens, key_padding_mask=padding_mask) if FIXED else encoder(tokens)
    real = (~padding_mask).float().unsqueeze(-1)
    return (hidden * real).sum(1) / real.sum(1)


def main():
    torch.manual_seed(0)
    tokens = torch.tensor([[0, 0, 0, 4, 5], [7, 8, 9, 10, 11], [0, 3, 6, 2, 1]])
    with torch.no_grad():
        pooled = step(Encoder().eval(), tokens)
    print("pooled", tuple(pooled.shape))


if __name__ == "__main__":
    main()
