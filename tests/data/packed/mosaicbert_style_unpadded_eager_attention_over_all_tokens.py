# Written another way (a MosaicBERT-style encoder, after prescient-design/lobster fd2fbe2): the model unpads a
# left-padded batch (flash_attn's unpad_input) and hands each layer `cu_seqlens=` by keyword; without the fused kernel
# the layer's eager fallback softmaxes over all the batch's real tokens at once, so each sequence attends to the
# others. The fix (MosaicBERT's own fallback) pads the tokens back to (B, L) and adds the key-padding bias.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
HEADS, DIM = 2, 16


class UnpadSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.Wqkv = nn.Linear(DIM, 3 * DIM)

    def forward(self, hidden, cu_seqlens=None, indices=None, padded_shape=None, bias=None):
        qkv = self.Wqkv(hidden).view(-1, 3, HEADS, DIM // HEADS)  # (total_nnz, 3, H, d)
        if not FIXED:
            q, k, v = qkv.permute(1, 2, 0, 3)[:, None]  # (1, H, total_nnz, d): the batch's real tokens, one sequence
            scores = q @ k.transpose(-1, -2) / (DIM // HEADS) ** 0.5
            out = torch.softmax(scores, dim=-1) @ v
            return out[0].transpose(0, 1).reshape(-1, DIM)
        b, n = padded_shape
        full = hidden.new_zeros(b * n, 3, HEADS, DIM // HEADS)
        full[indices] = qkv
        q, k, v = full.view(b, n, 3, HEADS, -1).permute(2, 0, 3, 1, 4)  # (B, H, L, d)
        scores = q @ k.transpose(-1, -2) / (DIM // HEADS) ** 0.5 + bias
        out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b * n, DIM)
        return out[indices]


class Encoder(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(30, DIM)
        self.layers = nn.ModuleList(UnpadSelfAttention() for _ in range(layers))

    def forward(self, input_ids, attention_mask):
        b, n = input_ids.shape
        lengths = attention_mask.sum(-1, dtype=torch.int32)
        indices = torch.nonzero(attention_mask.flatten()).flatten()
        cu_seqlens = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
        bias = torch.zeros(b, 1, 1, n).masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
        hidden = self.embed(input_ids).view(b * n, DIM)[indices]
        for layer in self.layers:
            hidden = hidden + layer(hidden, cu_seqlens=cu_seqlens, indices=indices, padded_shape=(b, n), bias=bias)
        out = hidden.new_zeros(b * n, DIM)
        out[indices] = hidden
        return out.view(b, n, DIM)


model = Encoder().eval()
lengths = [9, 5, 7]
ids = torch.randint(1, 30, (3, 9))
mask = torch.zeros(3, 9, dtype=torch.long)
for row, length in enumerate(lengths):
    mask[row, 9 - length:] = 1  # left padding
with torch.no_grad():
    batched = model(ids, attention_mask=mask)
    apart = max((batched[r, 9 - n:] - model(ids[r:r + 1, 9 - n:], attention_mask=mask[r:r + 1, 9 - n:])[0]).abs().max().item()
                for r, n in enumerate(lengths))
print(f"max |batched - each sequence alone|: {apart:.6f}")
