# The poprox-recommender NRMS bug (CCRI-POPROX/poprox-recommender#177, commit 6b83e63) written another way: a
# session recommender's item encoder, nn.MultiheadAttention in its default sequence-first layout (L, N, E), over
# right-padded sessions embedded with nn.Embedding(padding_idx=0) (zero vectors at the pads), handed no
# key_padding_mask, then mean-pooled over the real items. The fix hands `key_padding_mask=(sessions == 0)`.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(3)
ITEMS, DIM, HEADS, MAX_LEN = 50, 32, 2, 9

embedding = nn.Embedding(ITEMS, DIM, padding_idx=0)
encoder = nn.MultiheadAttention(DIM, HEADS)  # batch_first=False: (L, N, E)
encoder.eval()

sessions = torch.zeros(4, MAX_LEN, dtype=torch.long)
for row, length in enumerate((9, 5, 3, 6)):
    sessions[row, :length] = torch.randint(1, ITEMS, (length,))
pads = sessions == 0


def session_vectors() -> torch.Tensor:
    items = embedding(sessions).transpose(0, 1)  # (L, N, E)
    if FIXED:
        mixed, _ = encoder(items, items, items, key_padding_mask=pads)
    else:
        mixed, _ = encoder(items, items, items)
    mixed = mixed.transpose(0, 1) * (~pads).unsqueeze(-1)
    return mixed.sum(1) / (~pads).sum(1, keepdim=True)


with torch.no_grad():
    vectors = session_vectors()
    scores = vectors @ embedding.weight[1:].T
    print("top items:", scores.topk(3).indices.tolist())
