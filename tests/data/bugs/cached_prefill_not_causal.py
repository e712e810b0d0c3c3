"""Mikyx-1/TinyLLM#17, fixed by #18: MultiHeadAttention applied the causal mask only `if cache is None`; generate()'s
prefill passes the whole prompt with a cache attached, so every prompt token attended to later prompt tokens
(teacher-forced forward passes, with no cache, were causal and right). The fix masks whenever more than one new
token comes in."""

import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class MultiHeadAttention(nn.Module):
    def __init__(self, dim=8, max_len=16):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.register_buffer("causal_mask", torch.triu(torch.ones(max_len, max_len, dtype=torch.bool), diagonal=1))

    def forward(self, x, cache=None):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        T_new = q.shape[2]
        scores = q @ k.transpose(-2, -1) / 8 ** 0.5
        if (cache is None) if not FIXED else T_new > 1:
            scores = scores.masked_fill(self.causal_mask[:T_new, :T_new], float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v).squeeze(1)


class TinyLLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.attn = MultiHeadAttention()
        self.head = nn.Linear(8, 16)

    def forward(self, idx, cache=None):
        return self.head(self.attn(self.embed(idx), cache))


torch.manual_seed(0)
model = TinyLLM().eval()
prompt = torch.tensor([[1, 2, 3, 4, 5]])
with torch.no_grad():
    model(prompt)  # a teacher-forced forward pass, as the loss computes it
    cache = {}
    logits = model(prompt, cache)  # generate(): the prefill
    for _ in range(2):
        logits = model(logits[:, -1:].argmax(-1), cache)
