"""Left-padded features handed with their float `input_mask` to a model that reads only `attention_mask`: written
otherwise than sktime#10685 (checks/padded.py's zero-padding-attended).

Bug: `encode()` left-pads each clip's (S, C) features with zero frames and builds `input_mask` (1.0 = real), but the
model's forward masks with its `attention_mask` argument alone, left None: SDPA runs with no mask over frame pairs
(two frames a key) and the real pairs attend the zero ones.
Fix: the mask is handed as `attention_mask=`.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class PairEncoder(nn.Module):
    def __init__(self, channels=3, dim=8, heads=2):
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(2 * channels, dim)
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, feats, input_mask=None, attention_mask=None):
        b, s, c = feats.shape
        x = self.proj(feats.reshape(b, s // 2, 2 * c))  # two frames a token
        q, k, v = self.qkv(x).view(b, s // 2, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        keep = None
        if attention_mask is not None:
            keep = attention_mask.reshape(b, s // 2, 2).amin(-1).bool()[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return out.transpose(1, 2).reshape(b, s // 2, -1)


def encode(model, clips):
    width = max(len(c) for c in clips)
    feats = torch.stack([torch.cat([torch.zeros(width - len(c), 3), c]) for c in clips])
    input_mask = torch.stack([torch.cat([torch.zeros(width - len(c)), torch.ones(len(c))]) for c in clips])
    if FIXED:
        return model(feats, attention_mask=input_mask)
    return model(feats, input_mask=input_mask)


if __name__ == "__main__":
    model = PairEncoder().eval()
    long, short = torch.randn(8, 3) + 1.0, torch.randn(4, 3) + 1.0
    with torch.no_grad():
        out = encode(model, [long, short])
        alone = encode(model, [short])
    print("fixed" if FIXED else "buggy", "padded vs alone:", f"{(out[1, -2:] - alone[0]).abs().max().item():.4f}")
