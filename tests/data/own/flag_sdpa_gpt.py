"""A small GPT whose attention module keeps `self.is_causal = True` but hands SDPA only the mask it was given (none
for a training batch), so the causal flag never reaches the kernel; --fixed: is_causal=self.is_causal where no mask
is given."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.is_causal = True
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, attn_mask=None):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        causal = FIXED and attn_mask is None and self.is_causal
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)
        return y.transpose(1, 2).reshape(b, t, d)


class GPT(torch.nn.Module):
    def __init__(self, vocab=20, dim=16, heads=2, layers=2):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(CausalSelfAttention(dim, heads) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = GPT().eval()
    with torch.no_grad():
        logits = model(torch.randint(0, 20, (3, 7)))
    print("logits", tuple(logits.shape))
