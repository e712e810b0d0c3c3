"""A causal float mask for nn.MultiheadAttention built with diagonal=0, hiding each token's own key too.

Written another way than LLMs-from-scratch#1061: MHA (not SDPA), an additive -inf mask, batch_first; the first token
sees no key at all (NaN there), though token 0 is a key every later token sees. Fix: `triu(..., diagonal=1)`."""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def main():
    torch.manual_seed(0)
    length = 5
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(3, length, 8)
    mask = torch.triu(torch.full((length, length), float("-inf")), diagonal=1 if FIXED else 0)
    with torch.no_grad():
        out, _ = mha(x, x, x, attn_mask=mask, need_weights=False)
    print("finite rows", torch.isfinite(out).all(dim=-1).sum().item())


if __name__ == "__main__":
    main()
