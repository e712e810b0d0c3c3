# The slip of mead-baseline#223 (an out-of-place masked_fill whose result is dropped) written as a Luong "general"
# attention over a whole teacher-forced target at once: bmm scores (B, T, S), `scores.masked_fill(~src_mask, -inf)` as
# a statement, then softmax over the source; left-padded sources. The fix assigns the fill's result.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(5)
HIDDEN = 12


class LuongAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.W_a = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, decoder_states, encoder_outputs, src_mask):
        scores = torch.bmm(decoder_states, self.W_a(encoder_outputs).transpose(1, 2))  # (B, T, S)
        if FIXED:
            scores = scores.masked_fill(~src_mask[:, None, :], float("-inf"))
        else:
            scores.masked_fill(~src_mask[:, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return torch.bmm(weights, encoder_outputs), weights


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, HIDDEN)
        self.encoder = nn.GRU(HIDDEN, HIDDEN, batch_first=True)
        self.decoder = nn.GRU(HIDDEN, HIDDEN, batch_first=True)
        self.attention = LuongAttention()

    def forward(self, src, src_mask, tgt):
        encoder_outputs, hidden = self.encoder(self.embed(src))
        decoder_states, _ = self.decoder(self.embed(tgt), hidden)
        context, weights = self.attention(decoder_states, encoder_outputs, src_mask)
        return context, weights


model = Seq2Seq().eval()
src = torch.tensor([[0, 0, 0, 4, 5, 6], [7, 8, 9, 10, 11, 12]])  # pad id 0, row 0 left-padded
src_mask = src != 0
tgt = torch.tensor([[1, 2, 3, 4], [1, 5, 6, 7]])
with torch.no_grad():
    context, weights = model(src, src_mask, tgt)
print("weight on padded source positions:", weights[0, :, :3].sum().item())
