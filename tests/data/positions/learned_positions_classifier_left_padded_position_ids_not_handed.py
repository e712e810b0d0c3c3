"""A sequence classifier with learned absolute positions scores a left-padded batch; its caller hands no position_ids.

Written another way from OpenRLHF#217 (the reward model and critic called with input_ids and attention_mask only):
here a hand-written encoder-style scorer (a `pos_embed` table, eager softmax over a causal mask with the padding
filled by finfo.min) takes `position_ids=None` and numbers its columns `arange(L)` when handed none. The scoring loop
hands it the batch's attention_mask only, so a row with k pads on its left embeds its first real token at position k:
the same answer scores differently by how much padding the batch gave it. The fix hands
`position_ids = attention_mask.cumsum(-1) - 1`, pads set to 0.
"""

import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
VOCAB, D, HEADS, PAD = 40, 24, 3, 0


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, h, bias):
        b, n, _ = h.shape
        x = self.norm(h)
        q, k, v = (f(x).view(b, n, HEADS, D // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / (D // HEADS) ** 0.5 + bias
        weights = scores.softmax(-1)
        return h + self.o((weights @ v).transpose(1, 2).reshape(b, n, D))


class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embed = nn.Embedding(VOCAB, D)
        self.pos_embed = nn.Embedding(32, D)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.value = nn.Linear(D, 1)

    def forward(self, input_ids, attention_mask, position_ids=None):
        n = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(n)[None].expand_as(input_ids)
        h = self.tok_embed(input_ids) + self.pos_embed(position_ids)
        allowed = torch.ones(n, n, dtype=torch.bool).tril()[None] & attention_mask.bool()[:, None, :]
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
        for layer in self.layers:
            h = layer(h, bias)
        return self.value(h).squeeze(-1)[:, -1]  # the last column: every row ends with its answer's last token


def score(model, input_ids, attention_mask):
    if FIXED:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return model(input_ids, attention_mask, position_ids=position_ids)
    return model(input_ids, attention_mask)


torch.manual_seed(0)
model = Scorer().eval()
answers = [[7, 12, 5, 30, 9, 14], [21, 3, 17, 8]]
width = max(map(len, answers))
ids = torch.tensor([[PAD] * (width - len(a)) + a for a in answers])
mask = (torch.arange(width)[None] >= torch.tensor([width - len(a) for a in answers])[:, None]).long()
with torch.no_grad():
    batched = score(model, ids, mask)
    alone = score(model, torch.tensor([answers[1]]), torch.ones(1, len(answers[1]), dtype=torch.long))
print(f"row 1 batched {batched[1].item():.5f}, alone {alone[0].item():.5f}")
