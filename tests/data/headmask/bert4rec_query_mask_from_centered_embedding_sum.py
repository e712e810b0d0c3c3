# The TiSASRec mask bug (JiachengLi1995/TiSASRec#1, commit 1bd63d0) written another way: a bidirectional BERT4Rec-style
# encoder over a right-padded batch, per-head einsum attention. The key mask comes from the ids (id 0 = padding); the
# query mask multiplied into the weights after the softmax comes from `emb.sum(-1) != 0`, which calls padding a real
# item whose (mean-centred) embedding sums to exactly 0. The fix tests `emb.abs().sum(-1) != 0`: only zero rows.
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(1)
B, T, D, H, ITEMS = 3, 10, 16, 4, 30

table = torch.randint(-4, 5, (ITEMS, D)).float() / 4
table[7] = torch.tensor([1.0, -1.0] * (D // 2)) / 2  # a real item whose vector sums to exactly 0
table[0] = 0.0  # padding_idx
ids = torch.zeros(B, T, dtype=torch.long)
for b, n in enumerate((10, 7, 4)):
    ids[b, :n] = torch.randint(1, ITEMS, (n,))
ids[0, 3] = ids[1, 5] = 7

wq, wk, wv = (torch.randn(D, D) / D ** 0.5 for _ in range(3))
pos = torch.randn(T, D) * 0.1


def real_rows(emb: torch.Tensor) -> torch.Tensor:
    if FIXED:
        return emb.abs().sum(-1) != 0
    return emb.sum(-1) != 0


def encoder_layer(x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    q, k, v = (torch.matmul(x, w).view(B, T, H, D // H) for w in (wq, wk, wv))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (D // H) ** 0.5
    key_pad = (ids == 0)[:, None, None, :]
    scores = scores.masked_fill(key_pad, float("-inf"))
    weights = F.softmax(scores, dim=-1)
    query_keep = real_rows(emb).float()[:, None, :, None]
    weights = weights * query_keep
    out = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(B, T, D)
    return x + out


with torch.no_grad():
    emb = F.embedding(ids, table, padding_idx=0)
    h = emb + pos
    for _ in range(2):
        h = encoder_layer(h, emb)
    print("real items treated as padding:", int(((ids != 0) & ~real_rows(emb)).sum()))
    print("masked-item logits:", h[:, :, :4].sum().item())
