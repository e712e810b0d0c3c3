"""A causal language model (`self.is_causal = True`) that appends summary tokens after each segment's tokens: the
summary tokens read the whole segment, and the buggy mask also lets every token read the summary tokens, so at the
second layer a token reads later tokens through them. nn.MultiheadAttention with a bool mask (True = masked).
--fixed hides the summary tokens from the tokens.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class SummaryLM(nn.Module):
    def __init__(self, vocab=50, width=16, heads=2, layers=2, summaries=2):
        super().__init__()
        self.is_causal = True
        self.summaries = nn.Parameter(torch.randn(summaries, width))
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.MultiheadAttention(width, heads, batch_first=True) for _ in range(layers))

    def forward(self, tokens):
        b, n = tokens.shape
        s = self.summaries.shape[0]
        x = torch.cat([self.embed(tokens), self.summaries[None].expand(b, -1, -1)], dim=1)
        masked = torch.ones(n + s, n + s, dtype=torch.bool).triu(1)  # True = masked: tokens causal
        masked[n:, :] = False  # the summary tokens read everything
        if FIXED:
            masked[:n, n:] = True
        else:
            masked[:, n:] = False
        for attn in self.layers:
            x = x + attn(x, x, x, attn_mask=masked, need_weights=False)[0]
        return x[:, :n], x[:, n:]


def main():
    torch.manual_seed(0)
    model = SummaryLM().eval()
    tokens = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        out, summary = model(tokens)
    print("token 0 out[:3]:", [round(v, 4) for v in out[0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
