"""A SASRec-style next-item recommender over histories padded on the LEFT (pmixer/SASRec.pytorch pads each user's
sequence on the left with item 0, `nn.Embedding(num_items + 1, d, padding_idx=0)`, and scores candidates from
`log_feats[:, -1, :]`), whose scoring reads each row's state at `lengths - 1`, the last index of a RIGHT-padded
history (RecBole's `gather_indexes(output, item_seq_len - 1)`), so a short history is scored from a pad position's
output. The model is called as a module (`model(seqs)`), returns its (B, L, D) states as a bare tensor, and builds its
own causal + key-padding mask from `seqs != 0`, handed to SDPA. `--fixed` reads `[:, -1]`, the newest item of every
left-padded row; each row's score is then checked against the same history run alone, unpadded.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(y.transpose(1, 2).reshape(b, n, d))


class SASRec(nn.Module):
    def __init__(self, num_items: int, d: int = 16, heads: int = 2, layers: int = 2, max_len: int = 8):
        super().__init__()
        self.item_emb = nn.Embedding(num_items + 1, d, padding_idx=0)
        self.pos_emb = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))

    def forward(self, seqs):
        n = seqs.shape[1]
        real = seqs != 0
        positions = (real.long().cumsum(1) - 1).clamp(min=0)  # each row's own positions, from its first item
        x = self.item_emb(seqs) + self.pos_emb(positions)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        # a pad query keeps its own key so that no row is empty (its output is never read)
        mask = (causal[None] & real[:, None, :]) | torch.eye(n, dtype=torch.bool)[None]
        for block in self.blocks:
            x = block(x, mask[:, None])
        return x

    def score(self, seqs, lengths, candidates):
        states = self(seqs)
        if FIXED:
            last = states[:, -1, :]
        else:
            index = (lengths - 1).view(-1, 1, 1).expand(-1, -1, states.shape[-1])
            last = states.gather(dim=1, index=index).squeeze(1)
        return (last[:, None, :] * self.item_emb(candidates)).sum(-1)


def left_padded(histories, width):
    seqs = torch.zeros(len(histories), width, dtype=torch.long)
    for row, items in enumerate(histories):
        seqs[row, width - len(items):] = torch.tensor(items)
    return seqs


def main():
    model = SASRec(num_items=30).eval()
    histories = [[3, 7, 1, 9, 4, 2, 8, 5], [11, 6, 20], [5, 14, 2, 17, 3, 9]]
    seqs = left_padded(histories, 8)
    lengths = torch.tensor([len(h) for h in histories])
    candidates = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    with torch.no_grad():
        scores = model.score(seqs, lengths, candidates)
        alone = torch.cat([model.score(torch.tensor([h]), torch.tensor([len(h)]), candidates[row:row + 1])
                           for row, h in enumerate(histories)])
    print("scores", [[round(v, 4) for v in row] for row in scores.tolist()])
    print("each row as its history alone:", torch.allclose(scores, alone, atol=1e-5))
    if FIXED:
        assert torch.allclose(scores, alone, atol=1e-5)


if __name__ == "__main__":
    main()
