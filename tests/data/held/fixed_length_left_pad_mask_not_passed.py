"""Prompts left-padded to a fixed length (so no row is whole), their attention_mask built and never handed on.

Bug: `score_prompts` builds `attention_mask` beside the padded `tokens` but calls the model with the tokens alone; the
model runs SDPA with is_causal=True, so every prompt's real tokens attend the pad tokens (id 3) in front of it.
Fix: the mask is handed on and combined with the causal triangle.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
PAD = 3
LENGTH = 7


class Scorer(nn.Module):
    def __init__(self, vocab=24, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, vocab)

    def forward(self, tokens, attention_mask=None):
        b, n = tokens.shape
        q, k, v = self.qkv(self.embed(tokens)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if attention_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keep = torch.ones(n, n, dtype=torch.bool).tril() & attention_mask.bool()[:, None, None, :]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep | ~keep.any(-1, keepdim=True))
        return self.out(y.transpose(1, 2).reshape(b, n, -1)).log_softmax(-1)


def score_prompts(model, prompts):
    tokens = torch.full((len(prompts), LENGTH), PAD)
    attention_mask = torch.zeros(len(prompts), LENGTH, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, LENGTH - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, LENGTH - len(prompt):] = 1
    logp = model(tokens, attention_mask) if FIXED else model(tokens)
    return (logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1) * attention_mask[:, 1:]).sum(-1)


torch.manual_seed(0)
with torch.no_grad():
    print("scores", score_prompts(Scorer(), [[5, 6, 7, 8, 9], [10, 11, 12]]).tolist())
