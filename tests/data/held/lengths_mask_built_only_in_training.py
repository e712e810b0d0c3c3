# The speechbrain#915 bug written another way (fairseq style): the encoder's padding mask is built from absolute
# `src_lengths` only under `self.training`, so an eval-mode batch of unequal utterances, padded on the right, attends
# its padded frames through SDPA (a bool keep mask of shape (B, 1, 1, T), None when not built).
# The fix builds it whenever `src_lengths` is given.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(1)


def lengths_to_padding_mask(lens):
    """fairseq's helper: True = padding."""
    return torch.arange(int(lens.max()))[None, :] >= lens[:, None]


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, encoder_padding_mask=None):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        keep = None if encoder_padding_mask is None else ~encoder_padding_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class EncoderLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attn = SelfAttention(dim, heads)
        self.norm = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, encoder_padding_mask=None):
        x = x + self.attn(self.norm(x), encoder_padding_mask)
        return x + self.ffn(x)


class SpeechEncoder(nn.Module):
    def __init__(self, feat=16, dim=24, heads=3, layers=2):
        super().__init__()
        self.proj = nn.Linear(feat, dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads) for _ in range(layers))

    def forward(self, src_tokens, src_lengths=None):
        encoder_padding_mask = None
        if src_lengths is not None and (FIXED or self.training):
            encoder_padding_mask = lengths_to_padding_mask(src_lengths)
        x = self.proj(src_tokens)
        for layer in self.layers:
            x = layer(x, encoder_padding_mask)
        return {"encoder_out": x, "encoder_padding_mask": encoder_padding_mask}


encoder = SpeechEncoder().eval()  # generation: the sequence generator runs the encoder in eval mode
lengths = torch.tensor([5, 11, 8])
batch = torch.zeros(3, 11, 16)
for i, n in enumerate(lengths.tolist()):
    batch[i, :n] = torch.randn(n, 16)
with torch.no_grad():
    out = encoder(batch, src_lengths=lengths)["encoder_out"]
    alone = encoder(batch[:1, :5], src_lengths=lengths[:1])["encoder_out"]
print(f"row 0, batched vs alone: {(out[0, :5] - alone[0]).abs().max().item():.6f}")
