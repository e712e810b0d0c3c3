# Written another way (the bug of RVC-Boss/GPT-SoVITS#2153: a pair mask from the padding's outer product that masks
# only the (pad query, pad key) pairs): a speech encoder over a right-padded batch of utterances; the batching helper
# holds their lengths and builds the keep mask the encoder hands to SDPA as `valid[:, :, None] | valid[:, None, :]` (True = keep), so every real
# frame still attends the padded frames after its utterance. The fix keeps the real keys for every query:
# `valid[:, None, :]` broadcast over the queries.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

FEATS, DIM, HEADS = 12, 32, 4


class SelfAttentionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x, keep):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep.unsqueeze(1))
        return x + self.proj(out.transpose(1, 2).reshape(b, t, DIM))


class SpeechEncoder(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.front = nn.Linear(FEATS, DIM)
        self.blocks = nn.ModuleList([SelfAttentionBlock() for _ in range(layers)])

    def forward(self, feats, keep):
        x = self.front(feats)
        for block in self.blocks:
            x = block(x, keep)
        return x


def encode_batch(encoder, feats, lengths):
    frames = torch.arange(feats.shape[1])
    valid = frames[None, :] < lengths[:, None]  # (B, T): True = a real frame
    if FIXED:
        keep = valid[:, None, :].expand(-1, feats.shape[1], -1)
    else:
        keep = valid[:, :, None] | valid[:, None, :]  # (B, T, T)
    return encoder(feats, keep).masked_fill(~valid[..., None], 0.0)


encoder = SpeechEncoder().eval()
lengths = torch.tensor([9, 5, 7])
feats = torch.randn(3, 9, FEATS)
for row, n in enumerate(lengths.tolist()):
    feats[row, n:] = 0.0  # (the collator's zero padding)
with torch.no_grad():
    batched = encode_batch(encoder, feats, lengths)
    diff = max((batched[i, :n] - encode_batch(encoder, feats[i:i + 1, :n], lengths[i:i + 1])[0]).abs().max().item()
               for i, n in enumerate(lengths.tolist()))
print(f"max |encoded frames in the padded batch - each utterance alone|: {diff:.6f}")
