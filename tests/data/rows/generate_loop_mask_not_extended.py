"""A generate loop written by hand that feeds each new token with the prompt's attention_mask, never extended.

`TinyLM.forward(input_ids, attention_mask, cache, cache_position)` builds its additive mask as transformers does: the
2-D mask padded with zeros up to the keys, AND-ed with causal from `cache_position`, filled with the dtype's minimum
before an eager softmax. The prompts are left-padded (lengths 3 and 5). The buggy loop keeps the prompt's (2, 5) mask
for every decode step, so each new token's own key reads as padding; `--fixed` appends a 1 a step.
`--inside`: the loop still hands the prompt's mask, but the model appends ones for the tokens it is fed itself.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
INSIDE = "--inside" in sys.argv
torch.manual_seed(11)


class TinyLM(nn.Module):
    def __init__(self, vocab=40, dim=16, heads=2):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask, cache, cache_position):
        b, n = input_ids.shape
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        keys = k.shape[2]
        if INSIDE and attention_mask.shape[1] < keys:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(b, keys - attention_mask.shape[1])], 1)
        padding = F.pad(attention_mask, (0, max(0, keys - attention_mask.shape[1])))[:, :keys].bool()
        allowed = (torch.arange(keys)[None, :] <= cache_position[:, None])[None, None] & padding[:, None, None, :]
        scores = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, self.dim)
        return self.out(y)


def main():
    model = TinyLM().eval()
    ids = torch.tensor([[0, 0, 7, 8, 9], [3, 4, 5, 6, 7]])
    mask = (ids != 0).long()
    cache = []
    with torch.no_grad():
        logits = model(ids, mask, cache, torch.arange(5))
        for step in range(3):
            token = logits[:, -1].argmax(-1, keepdim=True)
            if FIXED:
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            logits = model(token, mask, cache, torch.tensor([5 + step]))
    print("last logits", [round(x, 4) for x in logits[:, -1, :3].flatten().tolist()])


main()
