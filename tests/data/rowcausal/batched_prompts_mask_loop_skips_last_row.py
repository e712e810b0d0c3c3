"""A batched greedy decoder whose per-row causal masks are filled in a loop that stops one row short.

The prompts are all the same length (no padding). The model's forward builds a boolean (B, 1, L, L) mask of True
(attend everywhere) and writes each row's lower triangle in a loop over the batch, `range(batch - 1)`: the last row
keeps its all-True mask, so its prompt tokens see the tokens after them at the prefill. The decode steps behind the
cache are unaffected (one query sees every cached key). The fix loops over every row.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(3)
DIM, HEADS, VOCAB = 32, 2, 30


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, DIM) for _ in range(3))
        self.o = nn.Linear(DIM, DIM)

    def forward(self, x, mask, cache):
        b, length, _ = x.shape

        def heads(t):
            return t.view(b, -1, HEADS, DIM // HEADS).transpose(1, 2)

        k, v = heads(self.k(x)), heads(self.v(x))
        if cache:
            k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
        cache["k"], cache["v"] = k, v
        y = F.scaled_dot_product_attention(heads(self.q(x)), k, v, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(b, length, DIM))


class TinyLM(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(64, DIM)
        self.layers = nn.ModuleList(SelfAttention() for _ in range(layers))
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, start, caches):
        b, length = ids.shape
        x = self.embed(ids) + self.pos(torch.arange(start, start + length))[None]
        if length > 1:
            mask = torch.ones(b, 1, length, length, dtype=torch.bool)
            for row in range(b if FIXED else b - 1):
                mask[row, 0] = torch.tril(mask[row, 0])
        else:
            mask = None
        for layer, cache in zip(self.layers, caches):
            x = x + layer(x, mask, cache)
        return self.lm_head(x)


@torch.no_grad()
def generate(model, prompts, steps):
    caches = [{} for _ in model.layers]
    logits = model(prompts, 0, caches)
    out = [logits[:, -1].argmax(-1)]
    for step in range(steps - 1):
        logits = model(out[-1][:, None], prompts.shape[1] + step, caches)
        out.append(logits[:, -1].argmax(-1))
    return torch.stack(out, dim=1), logits[:, -1]


model = TinyLM().eval()
prompts = torch.randint(0, VOCAB, (3, 7))
tokens, last = generate(model, prompts, 4)
print("generated:", tokens.tolist())
print("last row's logits:", [round(x, 4) for x in last[-1, :4].tolist()])
