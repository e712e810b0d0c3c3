"""A batched sampling loop that extends the attention_mask with each row's "finished" flag instead of its negation.

`Decoder.forward(ids, attention_mask, past)` (an embedding with padding_idx 0, one SDPA layer over a list cache, a
boolean mask: the 2-D mask AND-ed with causal). The loop feeds one token a row per step and, once a row has emitted
EOS (id 2), feeds the pad id (0) there. The buggy loop appends `finished.long()`: a row still generating gets a 0 at
its new token, which its query then cannot see; `--fixed` appends `(~finished).long()`.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
EOS, PAD = 2, 0
torch.manual_seed(5)


class Decoder(nn.Module):
    def __init__(self, vocab=32, width=16, heads=4):
        super().__init__()
        self.heads = heads
        self.tokens = nn.Embedding(vocab, width, padding_idx=PAD)
        self.project = nn.Linear(width, 3 * width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids, attention_mask, past):
        batch, new = ids.shape
        h = self.tokens(ids)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.project(h).chunk(3, dim=-1))
        if past:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        past[:] = [k, v]
        total = k.shape[2]
        first = total - new
        causal = torch.arange(total)[None, :] <= (first + torch.arange(new))[:, None]
        allowed = causal[None, None] & attention_mask.bool()[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.head(y.transpose(1, 2).flatten(2))


def main():
    model = Decoder().eval()
    ids = torch.tensor([[PAD, 9, 10, 11], [5, 6, 7, 8]])
    mask = (ids != PAD).long()
    past, finished = [], torch.zeros(2, dtype=torch.bool)
    with torch.no_grad():
        logits = model(ids, mask, past)
        for _ in range(3):
            token = logits[:, -1].argmax(-1)
            token = torch.where(finished, torch.full_like(token, PAD), token)
            finished |= token == EOS
            mask = torch.cat([mask, ((~finished) if FIXED else finished).long()[:, None]], dim=1)
            logits = model(token[:, None], mask, past)
    print("last logits", [round(x, 4) for x in logits[:, -1, :3].flatten().tolist()])


main()
