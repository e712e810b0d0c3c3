"""A hand-written classifier whose embedding pads with id 0: the attention mask made from the ids the wrong way round."""
import sys
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
PAD = 0


class Classifier(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.tok = nn.Embedding(50, d, padding_idx=PAD)
        self.wq, self.wk = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, tokens):
        x = self.tok(tokens)
        scores = self.wq(x) @ self.wk(x).transpose(1, 2) / 8 ** 0.5
        keep = (tokens != PAD) if FIXED else (tokens == PAD)
        scores = scores.masked_fill(~keep[:, None, :], -1e9)
        return scores.softmax(-1) @ x


torch.manual_seed(0)
Classifier()(torch.tensor([[5, 6, 7, 8], [9, 10, PAD, PAD], [11, PAD, PAD, PAD]]))
