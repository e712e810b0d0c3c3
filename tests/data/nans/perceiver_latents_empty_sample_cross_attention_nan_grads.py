# A Perceiver-style encoder: learned latents cross-attend a padded batch of event sequences (a patient's visits, a
# user's clicks), heads folded into the batch for torch.bmm, the keys masked with -inf from the batch's lengths. One
# sample has no events at all, so every latent of that sample sees no key: its softmax rows are NaN. The head is
# trained on the samples that have events only, but backward goes through weightsᵀ @ grad, NaN x 0 = NaN, and every
# parameter's gradient is NaN. The fix zeroes the weights of the rows that see no key after the softmax.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class LatentCrossAttention(nn.Module):
    def __init__(self, dim=16, num_latents=4, heads=2):
        super().__init__()
        self.heads = heads
        self.latents = nn.Parameter(torch.randn(num_latents, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def fold(self, t):  # (B, L, H*d) -> (B*H, L, d), each sample's heads side by side
        b, n, c = t.shape
        return t.view(b, n, self.heads, c // self.heads).transpose(1, 2).reshape(b * self.heads, n, c // self.heads)

    def forward(self, events, lengths):
        b, n, c = events.shape
        q = self.fold(self.q(self.latents).expand(b, -1, -1))
        k, v = (self.fold(t) for t in self.kv(events).chunk(2, dim=-1))
        scores = torch.bmm(q, k.transpose(1, 2)) * (c // self.heads) ** -0.5
        key_real = (torch.arange(n)[None, :] < lengths[:, None]).repeat_interleave(self.heads, dim=0)  # (B*H, n)
        scores = scores.masked_fill(~key_real[:, None, :], float("-inf"))
        weights = scores.softmax(dim=-1)
        if FIXED:
            weights = weights.masked_fill(~key_real.any(dim=-1)[:, None, None], 0.0)
        pooled = torch.bmm(weights, v)
        pooled = pooled.view(b, self.heads, -1, c // self.heads).transpose(1, 2).reshape(b, -1, c)
        return self.out(pooled).mean(dim=1)


model = LatentCrossAttention()
classifier = nn.Linear(16, 1)
lengths = torch.tensor([5, 0, 3])  # the second sample has no events
events = torch.randn(3, 5, 16) * (torch.arange(5)[None, :] < lengths[:, None])[..., None]
labels = torch.tensor([1.0, 0.0, 0.0])

logits = classifier(model(events, lengths)).squeeze(-1)
has_events = lengths > 0
loss = nn.functional.binary_cross_entropy_with_logits(logits[has_events], labels[has_events])
loss.backward()
bad = [name for name, p in model.named_parameters() if torch.isnan(p.grad).any()]
print(f"loss {loss.item():.4f}; parameters with NaN gradients: {bad}")
