# The same bug as octo-pytorch 3380db5, written another way: a small GPT over a left-padded batch of three builds a
# (batch, 1, seq, seq) additive mask (causal and each row's left padding) and hands it to every block, whose attention
# "expects (seq, seq)" and takes `mask[0, 0]` before SDPA: every row is attended with row 0's mask. Row 0 is the
# longest prompt (no padding), so rows 1 and 2 attend to their own padding. The fix keeps the mask whole.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
PAD = 0


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if not FIXED and mask.dim() == 4:
            mask = mask[0, 0]  # SDPA takes a (seq, seq) mask: the first sample's is used for all of them
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=50, dim=32, heads=4, layers=2, max_len=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        b, n = idx.shape
        real = idx != PAD
        positions = (real.cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        keep = causal[None, None] & real[:, None, None, :]
        keep |= torch.eye(n, dtype=torch.bool)[None, None]  # (a padding query sees itself: no empty row)
        mask = torch.zeros(b, 1, n, n).masked_fill(~keep, float("-inf"))
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def main():
    torch.manual_seed(0)
    model = TinyGPT().eval()
    prompts = [[5, 9, 11, 3, 7, 2, 8], [4, 6, 12], [13, 10, 3, 9, 14]]
    n = max(len(p) for p in prompts)
    idx = torch.tensor([[PAD] * (n - len(p)) + p for p in prompts])
    with torch.no_grad():
        logits = model(idx)
        worst = 0.0
        for b, p in enumerate(prompts):
            alone = model(torch.tensor([p]))
            worst = max(worst, (logits[b, -1] - alone[0, -1]).abs().max().item())
    print(f"max |last logits (batched) - (alone)| = {worst:.6f}")


if __name__ == "__main__":
    main()
