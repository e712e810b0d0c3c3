"""A multiple-choice scorer over (batch, choices, tokens) ids, flattened to one encoder row per choice as
`*ForMultipleChoice` heads flatten them, whose key padding mask is handed to nn.MultiheadAttention the wrong way round.

Each choice is left-padded with the pad id its embedding states (`nn.Embedding(..., padding_idx=1)`). The scorer builds
`keep = flat != self.embed.padding_idx` (True = a real token) and hands it as `key_padding_mask`, which torch reads as
True = padding: every query of a choice sees only its padding. The fix hands `flat == padding_idx`. No 2-D ids and no
attention_mask reach the model call: the padding is stated by the 3-D ids beside the embedding's pad id alone, folded
into the attention's batch rows. `--fixed` runs the fix.
"""

import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
PAD = 1


class ChoiceScorer(nn.Module):
    def __init__(self, vocab=20, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.score = nn.Linear(dim, 1)

    def forward(self, choices):
        batch, n_choices, length = choices.shape
        flat = choices.view(-1, length)
        x = self.embed(flat)
        if FIXED:
            key_padding_mask = flat == self.embed.padding_idx
        else:
            key_padding_mask = flat != self.embed.padding_idx
        x, _ = self.attn(x, x, x, key_padding_mask=key_padding_mask)
        return self.score(x[:, -1]).view(batch, n_choices)


def main():
    torch.manual_seed(0)
    model = ChoiceScorer().eval()
    choices = torch.tensor([
        [[PAD, PAD, 4, 5, 6, 7], [7, 8, 9, 3, 2, 5], [PAD, PAD, PAD, 6, 4, 9]],
        [[PAD, 3, 3, 4, 8, 2], [PAD, PAD, PAD, PAD, 7, 5], [PAD, PAD, 2, 9, 6, 3]],
    ])
    with torch.no_grad():
        print(model(choices).argmax(-1).tolist())


if __name__ == "__main__":
    main()
