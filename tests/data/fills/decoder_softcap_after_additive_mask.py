"""A decoder's eager attention that soft-caps its logits (`self.attn_logit_softcap = 5.0`: cap * tanh(s / cap)) after
adding the HF-style additive mask (0 kept, finfo.min masked: a causal triangle over a left-padded batch), so every
masked cell comes out of the cap as -5, an ordinary logit beside scores of a few units: the padding and the future
keep softmax weight. --fixed caps the logits first and adds the mask after (Gemma 2's order).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class CappedSelfAttention(nn.Module):
    def __init__(self, width=16, heads=2, attn_logit_softcap=5.0):
        super().__init__()
        self.heads = heads
        self.attn_logit_softcap = attn_logit_softcap
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)

    def forward(self, hidden, attention_mask):
        b, n, d = hidden.shape
        q, k, v = self.qkv(hidden).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        logits = torch.matmul(q, k.transpose(2, 3)) / q.shape[-1] ** 0.5
        cap = self.attn_logit_softcap
        if FIXED:
            logits = cap * torch.tanh(logits / cap)
            logits = logits + attention_mask
        else:
            logits = logits + attention_mask
            logits = cap * torch.tanh(logits / cap)
        weights = F.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.out(torch.matmul(weights, v).transpose(1, 2).reshape(b, n, d))


def additive_mask(padding_mask, dtype=torch.float32):
    """(B, 1, L, L): 0 where a query may read a key (causal, a real key), finfo.min elsewhere."""
    n = padding_mask.shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & padding_mask[:, None, None, :].bool()
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def main():
    torch.manual_seed(0)
    padding_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])  # left-padded, 1 = real
    hidden = torch.randn(2, 6, 16)
    layer = CappedSelfAttention()
    with torch.no_grad():
        out = layer(hidden, additive_mask(padding_mask))
    print("last token of row 1 out[:3]:", [round(x, 4) for x in out[1, -1, :3].tolist()])


if __name__ == "__main__":
    main()
