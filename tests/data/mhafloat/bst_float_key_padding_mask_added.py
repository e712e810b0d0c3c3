# Written another way for ones-added (the SASRec.pytorch aab3261 bug, in the style of a Behavior Sequence Transformer
# recommender): an nn.MultiheadAttention(batch_first=True) over a right-padded batch of click histories, its
# key_padding_mask made as `(ids == 0).float()`: MHA adds a float key_padding_mask to the scores (+1 on a padded key,
# +0 on a real one), so the padded clicks are attended. The fix passes the bool `ids == 0` (True = padding).
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class BST(nn.Module):
    def __init__(self, n_items=30, d=16, heads=2):
        super().__init__()
        self.items = nn.Embedding(n_items, d, padding_idx=0)
        self.positions = nn.Embedding(16, d)
        self.encoder = nn.MultiheadAttention(d, heads, batch_first=True)
        self.out = nn.Linear(d, 1)

    def forward(self, history):
        x = self.items(history) + self.positions(torch.arange(history.shape[1]))
        pad = history == 0 if FIXED else (history == 0).float()
        h, _ = self.encoder(x, x, x, key_padding_mask=pad)
        real = (history != 0).unsqueeze(-1)
        return self.out((h * real).sum(1) / real.sum(1)).squeeze(-1)


model = BST().eval()
history = torch.tensor([[4, 9, 2, 17, 5, 0, 0, 0], [3, 8, 12, 6, 21, 11, 7, 14]])
with torch.no_grad():
    batched = model(history)
    alone = model(history[:1, :5])
print(f"fixed={FIXED}: |score of the padded history in the batch - alone| = {(batched[0] - alone[0]).abs().item():.3e}")
