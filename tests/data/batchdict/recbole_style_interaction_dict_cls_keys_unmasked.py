# The BST bug (datawhalechina/torch-rechub b0c1516: a behaviour sequence's pad slots attended) written another way:
# RecBole's style, the model handed an `interaction` dict, item sequences LEFT-padded with item 0 (the item
# embedding's padding_idx), a learned CLS token PREPENDED before the items, and a hand-written bidirectional encoder on
# F.scaled_dot_product_attention. Buggy: the attention gets no mask, so the CLS token pools the pad items of short
# sequences. Fixed: the mask is built from `item_seq != 0`, the CLS key kept.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Layer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, h, attn_mask):
        b, n, d = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.norm(h + self.out(o.transpose(1, 2).reshape(b, n, d)))


class SeqEncoder(nn.Module):
    """CLS + item sequence -> the CLS state scores every item (RecBole's SequentialRecommender, reduced)."""

    def __init__(self, n_items, hidden=16, heads=2, max_len=8, layers=2):
        super().__init__()
        self.item_embedding = nn.Embedding(n_items, hidden, padding_idx=0)
        self.position_embedding = nn.Embedding(max_len + 1, hidden)
        self.cls = nn.Parameter(torch.randn(1, 1, hidden) * 0.02)
        self.layers = nn.ModuleList([Layer(hidden, heads) for _ in range(layers)])

    def forward(self, interaction):
        item_seq = interaction["item_seq"]
        h = torch.cat([self.cls.expand(item_seq.size(0), -1, -1), self.item_embedding(item_seq)], dim=1)
        h = h + self.position_embedding(torch.arange(h.size(1)))[None]
        mask = None
        if FIXED:
            keep = torch.cat([torch.ones_like(item_seq[:, :1], dtype=torch.bool), item_seq != 0], dim=1)
            mask = keep[:, None, None, :]  # (B, 1, 1, 1 + L): True = attend
        for layer in self.layers:
            h = layer(h, mask)
        return h[:, 0] @ self.item_embedding.weight.T


n_items, max_len = 40, 8
lengths = [8, 3, 5]
item_seq = torch.zeros(3, max_len, dtype=torch.long)
for b, n in enumerate(lengths):
    item_seq[b, max_len - n:] = torch.randint(1, n_items, (n,))  # left padding, the latest item last
interaction = {"item_seq": item_seq, "item_seq_len": torch.tensor(lengths), "pos_items": torch.tensor([3, 9, 21])}

model = SeqEncoder(n_items, max_len=max_len)
logits = model(interaction)
loss = F.cross_entropy(logits, interaction["pos_items"])
loss.backward()
print("mode:", "fixed" if FIXED else "buggy", "loss: %.4f" % loss.item())
