"""A slot-memory update: each memory slot attends over [its own slot, the input tokens], the mask combined in place.

The slots' mask (slots, slots + n) lets slot i see itself and every input token; the batch's key padding (batch,
slots + n) is `&=`-ed into it. With as many samples as slots (4 and 4) the combine runs, and slot i of every sample is
masked with sample i's padding. --fixed lays the padding on each sample's keys: (batch, 1, slots, slots + n).
"""
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
B, SLOTS, N, D, H = 4, 4, 6, 16, 2
to_q, to_kv = torch.nn.Linear(D, D), torch.nn.Linear(D, 2 * D)


def main():
    lengths = [6, 3, 5, 2]
    tokens = torch.randn(B, N, D)
    memory = torch.randn(B, SLOTS, D)

    padding = torch.ones(B, SLOTS + N, dtype=torch.bool)
    for b, n in enumerate(lengths):
        padding[b, SLOTS + n:] = False
    base = torch.cat([torch.eye(SLOTS, dtype=torch.bool), torch.ones(SLOTS, N, dtype=torch.bool)], dim=1)
    if FIXED:
        mask = base[None, None] & padding[:, None, None, :]
    else:
        mask = base.clone()
        mask &= padding  # (batch == slots: broadcasts as (slots, slots + n))
        mask = mask[None, None]

    context = torch.cat([memory, tokens], dim=1)
    q = to_q(memory).view(B, SLOTS, H, D // H).transpose(1, 2)
    k, v = to_kv(context).view(B, SLOTS + N, 2, H, D // H).permute(2, 0, 3, 1, 4)
    scores = (q @ k.transpose(-1, -2)) / (D // H) ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    updated = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, SLOTS, D)
    print("updated memory norm per sample:", [round(float(x), 4) for x in updated.norm(dim=(1, 2))])


with torch.no_grad():
    main()
