# A sentence encoder that appends a learned summary token to a padded batch and pools it: the pair mask of the tokens
# (valid x valid) is extended by a row and a column of ones for the summary token, so the summary attends the padding
# of every shorter sentence (F.scaled_dot_product_attention, bool mask True = attend, pad id 0, lengths differ per row).
# Fixed: the summary token's row and column take the tokens' validity.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(5)


class SummaryEncoder(nn.Module):
    def __init__(self, vocab=30, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.summary = nn.Parameter(torch.randn(1, 1, dim))
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, tokens):
        B, T = tokens.shape
        valid = tokens.ne(self.emb.padding_idx)
        x = torch.cat([self.emb(tokens), self.summary.expand(B, 1, -1)], dim=1)
        pair = torch.ones(B, T + 1, T + 1, dtype=torch.bool)
        pair[:, :T, :T] = valid[:, :, None] & valid[:, None, :]
        if FIXED:
            with_summary = torch.cat([valid, torch.ones(B, 1, dtype=torch.bool)], dim=1)
            pair[:, T, :] = with_summary
            pair[:, :, T] = with_summary
        q, k, v = self.qkv(x).view(B, T + 1, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=pair[:, None])
        return self.proj(out.transpose(1, 2).reshape(B, T + 1, -1))[:, T]


encoder = SummaryEncoder().eval()
sentences = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12]]
tokens = torch.tensor([s + [0] * (5 - len(s)) for s in sentences])
with torch.no_grad():
    pooled = encoder(tokens)
    alone = encoder(torch.tensor([sentences[2]]))
print(f"fixed={FIXED} max |pooled sentence 2 - alone| = {(pooled[2] - alone[0]).abs().max().item():.4f}")
