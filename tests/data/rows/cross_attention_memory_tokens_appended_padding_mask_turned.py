"""A captioning decoder whose cross-attention appends learned memory tokens to the encoder's frames and is handed the
encoder's padding mask the other way round.

Written here, beside checks/memturned.py, as muse-maskgit-pytorch 83aea2d's slip written another way: the encoder
(nn.TransformerEncoder) is handed `src_key_padding_mask` (True = padding), and the decoder's cross-attention, which
appends 2 learned memory tokens after the frames (always attended), hands SDPA `cat([pad, ones])` as its bool
attn_mask, where SDPA reads True = attend: each caption token sees the padded frames and the memory tokens, none of
the real frames. Fix: `cat([~pad, ones])`.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class CrossAttention(nn.Module):
    def __init__(self, dim=32, heads=4, memory_tokens=2):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.memory_tokens = nn.Parameter(torch.randn(memory_tokens, dim))
        self.out = nn.Linear(dim, dim)

    def forward(self, x, frames, pad):
        b, length, dim = x.shape
        context = torch.cat([frames, self.memory_tokens.expand(b, -1, -1)], dim=1)
        q = self.q(x).view(b, length, self.heads, -1).transpose(1, 2)
        k, v = self.kv(context).view(b, context.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        keep = torch.cat([~pad if FIXED else pad, torch.ones(b, self.memory_tokens.shape[0], dtype=torch.bool)], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        return x + self.out(out.transpose(1, 2).reshape(b, length, dim))


class Captioner(nn.Module):
    def __init__(self, vocab=30, dim=32):
        super().__init__()
        layer = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.embed = nn.Embedding(vocab, dim)
        self.cross_attn = CrossAttention(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, frames, pad, ids):
        memory = self.encoder(frames, src_key_padding_mask=pad)
        return self.head(self.cross_attn(self.embed(ids), memory, pad))


def main():
    model = Captioner().eval()
    lengths = [7, 4, 5]
    frames = torch.randn(3, 7, 32)
    pad = torch.arange(7)[None, :] >= torch.tensor(lengths)[:, None]  # True = padding
    ids = torch.randint(0, 30, (3, 9))
    with torch.no_grad():
        logits = model(frames, pad, ids)
    print("logits[:, 0, :3]", logits[:, 0, :3].tolist())


if __name__ == "__main__":
    main()
