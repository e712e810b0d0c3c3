"""A packing collator that returns `position_ids` restarting at 0 for each packed sample (two rows, three documents
in the second), and a training step that calls a plain causal SDPA model without them: documents see each other.
--fixed builds the document mask from the position_ids it holds.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def collate(samples, length=8):
    ids, position_ids = [], []
    for row in samples:
        flat = [token for sample in row for token in sample]
        ids.append(flat + [0] * (length - len(flat)))
        position_ids.append([p for sample in row for p in range(len(sample))] + [0] * (length - len(flat)))
    return torch.tensor(ids), torch.tensor(position_ids)


class Model(nn.Module):
    def __init__(self, vocab=30, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, ids, mask=None):
        x = self.embed(ids)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def step(model, samples):
    ids, position_ids = collate(samples)
    mask = None
    if FIXED:
        doc = torch.cumsum((position_ids == 0).int(), dim=1)
        t = ids.shape[1]
        mask = ((doc[:, :, None] == doc[:, None, :]) & torch.ones(t, t, dtype=torch.bool).tril())[:, None]
    return model(ids, mask)


def main():
    torch.manual_seed(0)
    with torch.no_grad():
        out = step(Model().eval(), [[[5, 6, 7, 8, 9, 10, 11, 12]], [[3, 4, 5], [6, 7], [8, 9, 10]]])
    print("out", tuple(out.shape))


if __name__ == "__main__":
    main()
