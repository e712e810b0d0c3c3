"""torchrl#3887's slip written another way: a PPO critic scores each prompt + response of a LEFT-padded rollout batch
(generation pads prompts on the left) with a value head over a hand-written decoder, then reads each row's final value
in a loop, one row at a time, at `lengths[i] - 1`: the last index of a RIGHT-padded row, so a short row's value is a
pad position's. The decoder is handed the batch's attention_mask and returns `(hidden_states, attentions)`, as
transformers' models do with return_dict=False; the value head is `nn.Linear(d, 1)` squeezed. `--fixed` reads
`values[i, -1]`, each row's last token; its values are then checked against each row run alone, unpadded.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


class Decoder(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(32, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, input_ids, attention_mask):
        b, n = input_ids.shape
        positions = (attention_mask.cumsum(1) - 1).clamp(min=0)
        x = self.emb(input_ids) + self.pos(positions)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        keep = attention_mask.bool()[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()
        keep = keep | torch.eye(n, dtype=torch.bool)  # (a pad query keeps its own key: no row empty)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return x + self.out(y.transpose(1, 2).reshape(b, n, -1)), None


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Decoder()
        self.value_head = nn.Linear(16, 1)

    def final_values(self, input_ids, attention_mask):
        hidden, _ = self.body(input_ids, attention_mask)
        values = self.value_head(hidden).squeeze(-1)  # (B, L): one value a position
        lengths = attention_mask.sum(-1).tolist()
        finals = []
        for i in range(input_ids.shape[0]):
            finals.append(values[i, -1] if FIXED else values[i, lengths[i] - 1])
        return torch.stack(finals)


def main():
    critic = Critic().eval()
    rows = [[5, 9, 3, 7, 1, 8, 2, 6], [12, 4, 8], [3, 3, 17, 21, 9]]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), PAD)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row):] = torch.tensor(row)
        attention_mask[i, width - len(row):] = 1
    with torch.no_grad():
        finals = critic.final_values(input_ids, attention_mask)
        alone = torch.cat([critic.final_values(torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long))
                           for row in rows])
    print("final values", [round(v, 4) for v in finals.tolist()])
    print("each row as it runs alone:", torch.allclose(finals, alone, atol=1e-5))
    if FIXED:
        assert torch.allclose(finals, alone, atol=1e-5)


if __name__ == "__main__":
    main()
