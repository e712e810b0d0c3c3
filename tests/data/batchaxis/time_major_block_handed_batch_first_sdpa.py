# The same bug as torch-rechub's BST (PR #195: an encoder that reads its input as (seq, batch, embed) handed
# (batch, seq, embed)), written as another project writes it: a sequential recommender whose self-attention block is
# ported from fairseq's time-major MultiheadAttention (`tgt_len, bsz, embed_dim = query.size()`) on
# F.scaled_dot_product_attention, its sizes in a dataclass, its features handed one by one (user, right-padded item
# history, target item, positional), the target appended to the history. Handed (batch, seq + 1, embed), the block
# takes the batch for the sequence: each behaviour attends to the same slot of the other users. The fix hands it the
# transpose and its padding.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class RecConfig:
    n_users: int = 40
    n_items: int = 60
    hidden: int = 24
    heads: int = 4
    max_len: int = 9
    pad_item: int = 0


class TimeMajorSelfAttention(nn.Module):
    """fairseq-style: query (tgt_len, bsz, embed_dim), key_padding_mask (bsz, src_len) True at padding."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, query, key_padding_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q, k, v = self.qkv(query).chunk(3, dim=-1)
        q, k, v = (t.contiguous().view(tgt_len, bsz * self.heads, self.head_dim).transpose(0, 1)
                   .view(bsz, self.heads, tgt_len, self.head_dim) for t in (q, k, v))
        mask = None
        if key_padding_mask is not None:
            mask = ~key_padding_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.view(bsz * self.heads, tgt_len, self.head_dim).transpose(0, 1).reshape(tgt_len, bsz, embed_dim)
        return self.out(y)


class SeqRec(nn.Module):
    def __init__(self, cfg: RecConfig):
        super().__init__()
        self.cfg = cfg
        self.user = nn.Embedding(cfg.n_users, cfg.hidden)
        self.item = nn.Embedding(cfg.n_items, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_len + 1, cfg.hidden)
        self.attn = TimeMajorSelfAttention(cfg.hidden, cfg.heads)
        self.head = nn.Sequential(nn.Linear(2 * cfg.hidden, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, user_id, item_seq, target_item):
        seq = torch.cat([self.item(item_seq), self.item(target_item)[:, None]], dim=1)  # (B, L + 1, H)
        seq = seq + self.pos(torch.arange(seq.shape[1]))
        if FIXED:
            padding = torch.cat([item_seq == self.cfg.pad_item, torch.zeros_like(target_item, dtype=torch.bool)[:, None]], 1)
            h = self.attn(seq.transpose(0, 1), key_padding_mask=padding).transpose(0, 1)
        else:
            h = self.attn(seq)
        interest = h[:, -1]  # the target's slot, after attending to the history
        return self.head(torch.cat([interest, self.user(user_id)], dim=-1)).squeeze(-1)


cfg = RecConfig()
model = SeqRec(cfg)
batch = 6
lengths = torch.tensor([9, 4, 7, 2, 9, 5])
item_seq = torch.full((batch, cfg.max_len), cfg.pad_item)
for b, n in enumerate(lengths.tolist()):
    item_seq[b, :n] = torch.randint(1, cfg.n_items, (n,))  # right-padded
user_id = torch.randint(0, cfg.n_users, (batch,))
target_item = torch.randint(1, cfg.n_items, (batch,))
label = torch.randint(0, 2, (batch,)).float()

opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    loss = F.binary_cross_entropy_with_logits(model(user_id, item_seq, target_item), label)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("fixed" if FIXED else "buggy", round(loss.item(), 4))
