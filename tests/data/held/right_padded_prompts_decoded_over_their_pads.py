"""Donut's batched prompts (NielsRogge/Transformers-Tutorials#323, written blind, blind-ja, round 60) written another way:
a hand-written decoder generates from two prompts right-padded to one length. `generate` holds the prompts'
`attention_mask` (1 = real) but builds its masks without it, causal only (as Donut's decoder rebuilt its mask all
ones), so every generated token attends the pads between its prompt and itself. `--fixed` pads the prompts on the
left and keeps the prompt's padding in every mask (the generated columns real): each row's generated tokens then
equal the row generated alone, unpadded (checked below).
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD, VOCAB, DIM = 0, 24, 16


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(32, DIM)
        self.qkv, self.head = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, VOCAB)

    def forward(self, ids, positions, keep, cache=None):
        x = self.embed(ids) + self.pos(positions)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if cache is not None:
            k, v = torch.cat([cache[0], k], 1), torch.cat([cache[1], v], 1)
        scores = (q @ k.transpose(1, 2)).masked_fill(~keep, float("-inf"))
        return self.head(scores.softmax(-1) @ v), (k, v)


def generate(model, ids, attention_mask, steps):
    rows, length = ids.shape
    real = attention_mask.bool() if FIXED else torch.ones_like(attention_mask, dtype=torch.bool)
    positions = (attention_mask.cumsum(1) - 1).clamp(min=0)
    keep = torch.ones(length, length, dtype=torch.bool).tril()[None] & real[:, None, :]
    logits, cache = model(ids, positions, keep)
    last = attention_mask.sum(1) - 1  # (the last real token: its position, and its place where right padded)
    token = logits[torch.arange(rows), length - 1 if FIXED else last].argmax(-1)
    out, position = [token], last + 1
    for step in range(steps - 1):
        total = length + step + 1
        seen = torch.cat([real, torch.ones(rows, step + 1, dtype=torch.bool)], 1)
        logits, cache = model(token[:, None], position[:, None], seen[:, None, :], cache)
        token, position = logits[:, -1].argmax(-1), position + 1
        out.append(token)
    return torch.stack(out, 1)


def main():
    model = Decoder().eval()
    prompts = [[5, 9, 3, 7, 11, 4], [12, 8, 6]]
    length = max(map(len, prompts))
    ids = torch.full((2, length), PAD)
    attention_mask = torch.zeros(2, length, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        at = slice(length - len(prompt), length) if FIXED else slice(0, len(prompt))
        ids[i, at] = torch.tensor(prompt)
        attention_mask[i, at] = 1
    with torch.no_grad():
        batch = generate(model, ids, attention_mask, 4)
        alone = [generate(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), 4)[0] for p in prompts]
    print("generated", batch.tolist(), "alone", [a.tolist() for a in alone])
    if FIXED:  # (the buggy run's short row continues past its pads: another answer)
        assert all(torch.equal(batch[i], alone[i]) for i in range(2))


if __name__ == "__main__":
    main()
