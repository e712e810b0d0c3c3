"""A sentence encoder whose attention module says `causal = False`, run on a padded batch and then an unpadded one.

Written for checks/directions.py (causal-but-said-not), another way than llm2vec#74: the module's attribute is
`causal`, the kernel a hand-written masked softmax, the batch right-padded, and the second batch (two unpadded
sentences) takes a "fast path" that reuses a lower-triangular mask copied from a GPT block (buggy). The fix builds
the key-padding mask on both paths.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.causal = heads, False
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        scores = scores.masked_fill(~keep, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d))


class Encoder(nn.Module):
    def __init__(self, vocab=50, dim=16, heads=2, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(SelfAttention(dim, heads) for _ in range(depth))

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        n = input_ids.shape[1]
        if not FIXED and bool(attention_mask.all()):
            keep = torch.ones(n, n, dtype=torch.bool).tril()[None, None]  # a fast path for unpadded batches
        else:
            keep = attention_mask.bool()[:, None, None, :]
        for block in self.blocks:
            x = x + block(x, keep)
        return (x * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)


if __name__ == "__main__":
    model = Encoder().eval()
    with torch.no_grad():
        padded = model(torch.tensor([[3, 9, 4, 7, 0], [5, 8, 2, 0, 0]]), torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]))
        whole = model(torch.tensor([[3, 9, 4, 7], [6, 1, 2, 8]]), torch.ones(2, 4, dtype=torch.long))
    print("fixed" if FIXED else "buggy", "same sentence, two batches:", f"{(padded[0] - whole[0]).abs().max().item():.4f}")
