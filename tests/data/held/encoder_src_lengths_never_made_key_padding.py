# The padding-unused slip of e2-tts-pytorch 58288b2 (a padding statement held, never handed to attention), written as
# a fairseq / ESPnet-style encoder: the batch is left-padded, the encoder holds its `src_lengths`, and its layers call
# nn.MultiheadAttention without any key_padding_mask. The fix builds the key padding from the lengths and hands it on.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, key_padding_mask=None):
        y, _ = self.self_attn(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)
        return self.norm(x + y)


class Encoder(nn.Module):
    def __init__(self, vocab=30, dim=16, heads=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads) for _ in range(layers))

    def forward(self, src_tokens, src_lengths):
        x = self.embed(src_tokens)
        T = src_tokens.shape[1]
        pad = torch.arange(T)[None, :] < (T - src_lengths)[:, None]  # left padding: the first T - len positions
        for layer in self.layers:
            x = layer(x, key_padding_mask=pad if FIXED else None)
        return x


src_lengths = torch.tensor([5, 8])
src_tokens = torch.randint(1, 30, (2, 8))
src_tokens[0, :3] = 0
encoder = Encoder().eval()
with torch.no_grad():
    batched = encoder(src_tokens, src_lengths)
    alone = encoder(src_tokens[:1, 3:], src_lengths[:1])
print(f"short row: max |batched - alone| = {(batched[0, 3:] - alone[0]).abs().max().item():.6f}")
