"""A value model over a left-padded batch, its per-row value read at the row's length less one (maskcli's own
reproduction of minimind 9c98cab / d7f4f4e's PPO critic bug, written another way: a hand-written causal decoder, no
transformers).

The batch is padded on the left (prompts of 9, 7 and 6 tokens, width 9). The buggy version reads each row's value at
`attention_mask.sum(-1) - 1`, the last position of a row padded on the right, so the shorter rows are read at a real
token in their middle; the fix reads the last column, every row's last token on a batch padded on the left.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x, mask):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(y.transpose(1, 2).reshape(b, n, c))


class Decoder(nn.Module):
    def __init__(self, vocab=32, d=32, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(16, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))

    def forward(self, input_ids, attention_mask):
        n = input_ids.shape[1]
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        x = self.embed(input_ids) + self.pos(positions)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        mask = mask | torch.eye(n, dtype=torch.bool)[None, None]  # (a pad query sees itself: no empty row)
        for block in self.blocks:
            x = block(x, mask)
        return x


torch.manual_seed(0)
model = Decoder().eval()
value_head = nn.Linear(32, 1)
lengths = torch.tensor([9, 7, 6])
attention_mask = (torch.arange(9)[None, :] >= (9 - lengths)[:, None]).long()
input_ids = torch.randint(1, 32, (3, 9)) * attention_mask
with torch.no_grad():
    values = value_head(model(input_ids, attention_mask)).squeeze(-1)  # (B, L)
    last = torch.full((3,), 8) if FIXED else attention_mask.sum(-1) - 1
    scores = values[torch.arange(3), last]
print("values at each row's end:", [round(v, 4) for v in scores.tolist()])
