"""Correct: an eager-softmax LM with rotary positions over a left-padded batch. The prompt's positions are
cumsum(mask) - 1 with the pads set to 1 (transformers' masked_fill(mask == 0, 1)), its pad query rows see no key (a
finfo.min fill: uniform weights); each decode step sits after every real token of its row
(mask.sum(-1) - 1 + 1 per step), the cache's keys first, then the step's own."""
import torch
from torch import nn


def rotate(x, position_ids):
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = position_ids[:, None, :, None].float() * freqs
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x2 * angles.cos() + x1 * angles.sin()], dim=-1)


class Layer(nn.Module):
    def __init__(self, hidden=32, heads=2):
        super().__init__()
        self.heads, self.q, self.k, self.v = heads, nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def split(self, x):
        return x.view(x.shape[0], x.shape[1], self.heads, -1).transpose(1, 2)

    def forward(self, x, position_ids, bias, past):
        q, k, v = (self.split(f(x)) for f in (self.q, self.k, self.v))
        q, k = rotate(q, position_ids), rotate(k, position_ids)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
        out = torch.softmax(scores, dim=-1) @ v
        return x + out.transpose(1, 2).reshape(x.shape), (k, v)


def bias_of(keep):
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)[:, None]


@torch.no_grad()
def main():
    torch.manual_seed(0)
    layers = nn.ModuleList(Layer() for _ in range(2)).eval()
    embed = nn.Embedding(40, 32)
    lengths = torch.tensor([9, 5])
    width = 9
    mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]  # left padding
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)
    keep = torch.tril(torch.ones(width, width, dtype=torch.bool))[None] & mask[:, None, :]
    x, caches = embed(torch.randint(1, 40, (2, width))), []
    for layer in layers:
        x, cache = layer(x, position_ids, bias_of(keep), None)
        caches.append(cache)
    for step in range(3):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.bool)], dim=1)
        position_ids = mask.sum(-1, keepdim=True) - 1
        x = embed(torch.randint(1, 40, (2, 1)))
        for i, layer in enumerate(layers):
            x, caches[i] = layer(x, position_ids, bias_of(mask[:, None, :]), caches[i])
    print(x.norm().item())


if __name__ == "__main__":
    main()
