"""OpenTau#524's slip written another way: a reward model scores RIGHT-padded prompt + answer rows with a
hand-written bidirectional encoder whose attention_mask is no 2-D one but a 4-D bool mask of the program's making,
`pad[:, None, :, None] & pad[:, None, None, :]` (pad x pad: a pad slot's query row sees no key at all), and reads each
row's reward at `[:, -1]`, the last column: a pad slot in every row shorter than the batch. `--fixed` appends a
learned reward token to each row (pad 1) right after its last real token and reads the reward there, gathered at
`lengths`; each reward is then checked against its row run alone, unpadded.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD, REWARD = 0, 39


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, attention_mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return x + self.out(torch.nan_to_num(y).transpose(1, 2).reshape(b, n, -1))


class Encoder(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16, heads: int = 2, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(32, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))

    def forward(self, input_ids, attention_mask):
        x = self.emb(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            x = block(x, attention_mask)
        return x


class RewardModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(16, 1)

    def forward(self, input_ids, pad):
        attn_4d = pad[:, None, :, None] & pad[:, None, None, :]
        hidden = self.encoder(input_ids, attention_mask=attn_4d)
        if FIXED:
            lengths = pad.sum(-1) - 1  # (the reward token: each row's last real slot)
            picked = hidden.gather(1, lengths[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
        else:
            picked = hidden[:, -1]
        return self.head(picked).squeeze(-1)


def main():
    model = RewardModel().eval()
    rows = [[5, 9, 3, 7, 1, 8, 2], [12, 4, 8], [3, 3, 17, 21, 9]]
    if FIXED:
        rows = [r + [REWARD] for r in rows]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), PAD)
    pad = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        input_ids[i, :len(r)] = torch.tensor(r)
        pad[i, :len(r)] = True
    with torch.no_grad():
        rewards = model(input_ids, pad)
        alone = torch.cat([model(torch.tensor([r]), torch.ones(1, len(r), dtype=torch.bool)) for r in rows])
    print("rewards", [round(v, 4) for v in rewards.tolist()])
    print("each row alone", [round(v, 4) for v in alone.tolist()])
    print("as run alone:", torch.allclose(rewards, alone, atol=1e-5))


if __name__ == "__main__":
    main()
