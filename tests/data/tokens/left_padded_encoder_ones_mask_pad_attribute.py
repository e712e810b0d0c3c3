"""A sentence encoder handed left-padded ids under its own name (`text`) and an all-ones mask: written otherwise than
SpeechT5#25908 (checks/tokens.py's padding-unmarked through the model call's first argument).

Bug: `embed()` pads each sentence on the left with the encoder's `pad_id` (0) to the batch's length, then hands it
`torch.ones_like(text)` as its attention_mask: every real token attends the pad tokens (SDPA, bool keep-mask).
Fix: the mask is `text != encoder.pad_id`.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Encoder(nn.Module):
    def __init__(self, vocab=20, dim=8, heads=2):
        super().__init__()
        self.pad_id = 0
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, text, attention_mask):
        b, n = text.shape
        x = self.embed(text)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        keep = attention_mask.bool()[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return out.transpose(1, 2).reshape(b, n, -1)


def embed(encoder, sentences):
    width = max(len(s) for s in sentences)
    text = torch.tensor([[encoder.pad_id] * (width - len(s)) + s for s in sentences])
    mask = (text != encoder.pad_id).long() if FIXED else torch.ones_like(text)
    return encoder(text, mask)[:, -1]


if __name__ == "__main__":
    encoder = Encoder().eval()
    with torch.no_grad():
        out = embed(encoder, [[5, 6, 7, 8, 9], [11, 12]])
        alone = embed(encoder, [[11, 12]])
    print("fixed" if FIXED else "buggy", "padded vs alone:", f"{(out[1] - alone[0]).abs().max().item():.4f}")
