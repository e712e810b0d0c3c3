# A funnel-style chunk pooler (one learned query per chunk of W tokens attends to its chunk, the chunks folded into
# the batch as `(b n) w`, as hourglass and funnel transformers shorten a sequence), on a left-padded batch whose
# padding the encoder holds as `attention_mask` (1 = real). The pooler's attention was handed its chunk as `context`
# with no mask, so a chunk's summary averaged in the padding at the start of a short row. The fix reads the padding
# in the same chunks, `attention_mask.reshape(-1, W)`, and hides those keys (a chunk of padding alone sees no key: under
# the finite fill its summary is uniform over its padding, a padding summary the shortened mask drops).
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class ChunkAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * dim, bias=False)

    def forward(self, queries, context, mask=None):
        n, w, d = context.shape
        h = self.heads
        q = self.q(queries).view(n, -1, h, d // h).transpose(1, 2)
        k, v = (t.view(n, w, h, d // h).transpose(1, 2) for t in self.kv(context).chunk(2, dim=-1))
        scores = torch.einsum("nhqd,nhkd->nhqk", q, k) / (d // h) ** 0.5
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None, :], -1e4)
        weights = scores.softmax(dim=-1)
        return torch.einsum("nhqk,nhkd->nhqd", weights, v).transpose(1, 2).reshape(n, -1, d)


class FunnelPooler(nn.Module):
    def __init__(self, dim=16, window=4):
        super().__init__()
        self.window = window
        self.summary = nn.Parameter(torch.randn(1, 1, dim))
        self.attn = ChunkAttention(dim)

    def forward(self, hidden, attention_mask):
        b, length, d = hidden.shape
        chunks = hidden.reshape(b * length // self.window, self.window, d)
        queries = self.summary.expand(chunks.shape[0], 1, d)
        chunk_mask = None
        if FIXED:
            chunk_mask = attention_mask.bool().reshape(-1, self.window)
        pooled = self.attn(queries, context=chunks, mask=chunk_mask).reshape(b, -1, d)
        short_mask = attention_mask.reshape(b, -1, self.window).amax(dim=-1)
        return pooled, short_mask


torch.manual_seed(0)
emb = nn.Embedding(30, 16)
pooler = FunnelPooler().eval()
lengths = [16, 10, 5]
ids = torch.randint(1, 30, (3, 16))
attention_mask = torch.zeros(3, 16, dtype=torch.long)
for row, n in enumerate(lengths):
    attention_mask[row, 16 - n:] = 1  # left padding
    ids[row, :16 - n] = 0
with torch.no_grad():
    pooled, short_mask = pooler(emb(ids), attention_mask)
    ids2 = ids.clone()
    ids2[1, :6] = torch.randint(1, 30, (6,))  # only row 1's padding changes
    pooled2, _ = pooler(emb(ids2), attention_mask)
real = short_mask[1].bool()
print(f"{'fixed' if FIXED else 'buggy'}: change of row 1's real summaries when only its padding changes = "
      f"{(pooled[1][real] - pooled2[1][real]).abs().max().item():.3e}")
