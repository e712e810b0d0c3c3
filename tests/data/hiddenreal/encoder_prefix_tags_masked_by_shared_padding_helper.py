# The slip of awslabs/sockeye#1087 written another way: a fairseq-style encoder over right-padded sources that start
# with a few prefix tags (a language tag, a task tag). One helper builds the source's key padding mask for the encoder's
# self-attention and for the decoder's cross-attention, and masks the prefix tags too whenever it is handed their
# counts (the cross-attention is meant not to read them). The encoder hands them on, so its self-attention hides the
# tags from every source token (nn.MultiheadAttention's key_padding_mask, True = padding). The fix: the encoder builds
# its mask from the lengths alone.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def source_padding_mask(src_lengths, max_len, prefix_lengths=None):
    """True where a key is hidden: past the source's length, and its prefix tags where their counts are given."""
    positions = torch.arange(max_len)[None, :]
    hidden = positions >= src_lengths[:, None]
    if prefix_lengths is not None:
        hidden |= positions < prefix_lengths[:, None]
    return hidden


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads, dropout=0.0)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x, encoder_padding_mask):  # x: (T, B, C), fairseq's time-major
        y, _ = self.self_attn(x, x, x, key_padding_mask=encoder_padding_mask, need_weights=False)
        x = self.norm1(x + y)
        return self.norm2(x + self.ffn(x))


class Encoder(nn.Module):
    def __init__(self, vocab=40, dim=32, heads=4, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim, padding_idx=1)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads) for _ in range(layers))

    def forward(self, src_tokens, src_lengths, prefix_lengths):
        x = self.embed_tokens(src_tokens).transpose(0, 1)
        if FIXED:
            encoder_padding_mask = source_padding_mask(src_lengths, src_tokens.size(1))
        else:
            encoder_padding_mask = source_padding_mask(src_lengths, src_tokens.size(1), prefix_lengths)
        for layer in self.layers:
            x = layer(x, encoder_padding_mask)
        return x.transpose(0, 1)


encoder = Encoder().train()  # (dropout 0: the training path, not the fused inference one)
src_lengths = torch.tensor([9, 7, 5])
prefix_lengths = torch.tensor([2, 1, 2])  # the tags that open each source
src_tokens = torch.randint(4, 40, (3, 9))
for row, n in enumerate(src_lengths.tolist()):
    src_tokens[row, n:] = 1
out = encoder(src_tokens, src_lengths, prefix_lengths)
ref = encoder(src_tokens, src_lengths, torch.zeros_like(prefix_lengths))
real = torch.arange(9)[None, :] < src_lengths[:, None]
print(f"max |encoder(tags hidden) - encoder(tags seen)| over real tokens = {(out - ref)[real].abs().max().item():.6f}")
