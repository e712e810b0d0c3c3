# The same bug as torch-rechub#229 (DIEN's AUGRU softmaxed each behavior's one score per step), written another way:
# a temporal-attention LSTM over right-padded sensor windows (DA-RNN style). Inside its loop over the time steps the
# module scores the step's hidden state against the query with a keepdim sum, (B, 1, 1), and takes F.softmax over
# its last axis: one element, so every weight is 1, the scores weigh nothing and the padded steps count as much as
# the real ones. The fix stacks the scores of all steps, masks the padding by the lengths and takes one softmax over
# time.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class TemporalAttentionLSTM(nn.Module):
    def __init__(self, n_in, hidden):
        super().__init__()
        self.cell = nn.LSTMCell(n_in, hidden)
        self.w = nn.Linear(hidden, hidden)
        self.query = nn.Parameter(torch.randn(hidden))
        self.head = nn.Linear(hidden, 1)

    def forward(self, x, lengths):
        b, t, _ = x.shape
        h = c = x.new_zeros(b, self.cell.hidden_size)
        states, scores, context = [], [], x.new_zeros(b, self.cell.hidden_size)
        for step in range(t):
            h, c = self.cell(x[:, step], (h, c))
            e = (torch.tanh(self.w(h)) * self.query).sum(dim=-1, keepdim=True).unsqueeze(1)  # (B, 1, 1)
            if FIXED:
                states.append(h)
                scores.append(e[:, 0, 0])
            else:
                alpha = F.softmax(e, dim=-1)  # over the one score of this step
                context = context + alpha[:, 0] * h
        if FIXED:
            e = torch.stack(scores, dim=1)  # (B, T)
            e = e.masked_fill(torch.arange(t)[None, :] >= lengths[:, None], float("-inf"))
            alpha = torch.softmax(e, dim=1)
            context = (alpha.unsqueeze(-1) * torch.stack(states, dim=1)).sum(1)
        return self.head(context)


lengths = torch.tensor([7, 4, 5])
x = torch.randn(3, 7, 3)
x[torch.arange(7)[None, :] >= lengths[:, None]] = 0.0  # right padding
model = TemporalAttentionLSTM(3, 8).eval()
with torch.no_grad():
    y = model(x, lengths)
    x2 = x.clone()
    x2[1, 4:] = 3.0  # only row 1's padding
    y2 = model(x2, lengths)
print("prediction:", [round(v, 5) for v in y[:, 0].tolist()])
print("|change| of row 1 when only its padding changes:", round(float((y2[1] - y[1]).abs().max()), 6))
