"""A sequence encoder over event histories handed as one batch object (a dataclass holding the right-padded features
and each row's length), its causal keep mask built with triu where tril was meant, so each event sees the events after
it and the row's trailing padding (--fixed: tril). Checked: the fix's real events match the short row run alone."""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


@dataclass
class EventBatch:
    data: torch.Tensor  # (B, T, F), zero past each row's length
    lengths: torch.Tensor  # (B,)


class EventEncoder(nn.Module):
    def __init__(self, features=6, d=16):
        super().__init__()
        self.proj, self.q, self.k, self.v = nn.Linear(features, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, batch: EventBatch):
        x = self.proj(batch.data)
        t = x.shape[1]
        ones = torch.ones(t, t, dtype=torch.bool)
        keep = ones.tril() if FIXED else ones.triu()
        scores = self.q(x) @ self.k(x).transpose(1, 2) / 4.0
        scores = scores.masked_fill(~keep, float("-inf"))
        return scores.softmax(-1) @ self.v(x)


torch.manual_seed(0)
model = EventEncoder().eval()
lengths = torch.tensor([7, 4])
data = torch.randn(2, 7, 6) * (torch.arange(7)[None, :, None] < lengths[:, None, None])
with torch.no_grad():
    out = model(EventBatch(data, lengths))
    alone = model(EventBatch(data[1:, :4], lengths[1:]))
print("row 1, event 0:", out[1, 0, :4].numpy().round(3))
if FIXED:
    assert torch.allclose(out[1, :4], alone[0], atol=1e-5)
