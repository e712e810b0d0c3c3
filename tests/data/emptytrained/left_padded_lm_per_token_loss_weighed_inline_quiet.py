"""The left-padded causal LM of left_padded_lm_trained_on_pad_rows_finite_fill.py, its pad rows filled whole with -1e9
(uniform weights over every key), trained with a per-token loss (`reduction="none"`) that the program weighs after it
returns by the attention mask of each prediction's position, written inline: the pad rows' predictions count for
nothing, and the loss equals the mean over each row's own tokens run alone, unpadded (checked below). Which targets
such a loss counts is the program's to say after the call; no rule may read them as counted (AllenNLP's
bidirectional LM weighs its two streams' losses so, `(nll * (mask & (targets != 0))).sum()`).
"""

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
PAD = 0


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(16, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask):
        b, n = input_ids.shape
        positions = (attention_mask.cumsum(1) - 1).clamp(min=0)
        x = self.emb(input_ids) + self.pos(positions)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        keep = torch.ones(n, n, dtype=torch.bool).tril() & attention_mask.bool()[:, None, None, :]
        weights = scores.masked_fill(~keep, -1e9).softmax(-1)
        x = x + self.out((weights @ v).transpose(1, 2).reshape(b, n, -1))
        return self.head(x)


def loss_of(model, input_ids, attention_mask):
    logits = model(input_ids, attention_mask)
    labels = input_ids[:, 1:]
    per_token = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (per_token * attention_mask[:, :-1].reshape(-1)).sum() / attention_mask[:, :-1].sum()


def main():
    model = TinyLM()
    rows = [[5, 9, 3, 7, 1, 8, 2], [12, 4, 8, 30], [3, 17, 21, 9, 6]]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), PAD)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row):] = torch.tensor(row)
        attention_mask[i, width - len(row):] = 1
    loss = loss_of(model, input_ids, attention_mask)
    loss.backward()
    with torch.no_grad():
        sums = [F.cross_entropy(model(torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))[0, :-1],
                                torch.tensor(r[1:]), reduction="sum") for r in rows]
        alone = sum(sums) / sum(len(r) - 1 for r in rows)
    print("loss", round(loss.item(), 5), "over the rows alone", round(alone.item(), 5))
    assert torch.allclose(loss, alone, atol=1e-5)


if __name__ == "__main__":
    main()
