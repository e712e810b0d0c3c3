"""A hand-written multi-head self-attention whose causal fill is thrown away (torch.masked_fill's function form).

Written for checks/discarded.py, another way than the blind reproductions (mead-baseline's 2-D Bahdanau energies,
ParlAI's 3-D codes attention over key padding): 4-D (B, H, L, L) scores of q @ kᵀ, `torch.masked_fill(scores, ~causal,
float("-inf"))` called as a statement, so every query sees the keys after it. `--fixed` fills in place
(`scores.masked_fill_(...)`); `--kept` binds the fill's result and softmaxes it, keeping the raw weights beside it
for a diagnostic (a correct program that also reads the unmasked scores while the fill is still held: quiet).
"""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
KEPT = "--kept" in sys.argv


def attend(x, wq, wk, wv, heads):
    b, n, d = x.shape
    q, k, v = (t.view(b, n, heads, d // heads).transpose(1, 2) for t in (x @ wq, x @ wk, x @ wv))
    scores = q @ k.transpose(-1, -2) / (d // heads) ** 0.5
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if FIXED:
        scores.masked_fill_(~causal, float("-inf"))
        weights = F.softmax(scores, dim=-1)
    elif KEPT:
        masked = torch.masked_fill(scores, ~causal, float("-inf"))
        raw = F.softmax(scores, dim=-1)  # (a diagnostic over the unmasked scores, the fill still held)
        weights = F.softmax(masked, dim=-1)
        print("raw entropy", round(float(-(raw * raw.log()).sum()), 3))
    else:
        torch.masked_fill(scores, ~causal, float("-inf"))
        weights = F.softmax(scores, dim=-1)
    return (weights @ v).transpose(1, 2).reshape(b, n, d)


def main():
    torch.manual_seed(0)
    d, heads = 16, 4
    wq, wk, wv = (torch.randn(d, d) / 4 for _ in range(3))
    x = torch.randn(2, 5, d)
    with torch.no_grad():
        y = attend(x, wq, wk, wv, heads)
    print("fixed" if FIXED else "kept" if KEPT else "buggy", tuple(y.shape), round(float(y.sum()), 4))


if __name__ == "__main__":
    main()
