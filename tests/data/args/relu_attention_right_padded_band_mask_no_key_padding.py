# The same bug as torch-rechub#244 (HSTU's silu attention masked only its causal triangle, never the PAD keys),
# written another way: a bidirectional ReLU-attention encoder over item histories padded on the right with
# pad_sequence to the pad id PAD = 99 (the embedding's padding_idx), einsum scores, a local band |i - j| <= 2
# filled with -inf outside, relu weights divided by the length. Only the band is masked: the real items near a row's
# end read the PAD items after them, so outputs move with the PAD embedding. The fix ANDs the key mask ids != PAD.
import sys

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 99


class ReluAttentionEncoder(nn.Module):
    def __init__(self, vocab, dim, band=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.act = nn.ReLU()
        self.band = band

    def forward(self, item_ids):
        x = self.embed(item_ids)
        length = item_ids.shape[1]
        scores = torch.einsum("bid,bjd->bij", self.q(x), self.k(x))
        pos = torch.arange(length)
        allowed = ((pos[:, None] - pos[None, :]).abs() <= self.band)[None]  # (1, L, L)
        if FIXED:
            allowed = allowed & (item_ids != PAD)[:, None, :]
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = self.act(scores) / length
        return x + torch.einsum("bij,bjd->bid", weights, self.v(x))


histories = [torch.tensor([5, 17, 3, 42]), torch.tensor([8, 21]), torch.tensor([11, 2, 30, 7, 64, 9])]
item_ids = pad_sequence(histories, batch_first=True, padding_value=PAD)  # (3, 6), PAD after each history
model = ReluAttentionEncoder(100, 16).eval()
with torch.no_grad():
    out = model(item_ids)
    model.embed.weight[PAD].add_(torch.randn(16))
    out2 = model(item_ids)
real = item_ids != PAD
print("max |change| at real items when only the PAD embedding changes:", round(float((out2 - out).abs().amax(-1)[real].max()), 6))
