"""A Bahdanau (additive) attention GRU decoder over a right-padded source batch, its source mask built and never used.

The classic PyTorch seq2seq tutorial layout: a bidirectional GRU encoder over packed sources, a decoder that at each
step scores every encoder state with `v^T tanh(W h + U s)`, softmaxes over the source positions and takes the weighted
sum as its context. `make_src_mask` builds `src != PAD` and hands it to the attention, whose `forward` takes it as
`mask` and, in the bug, never fills the scores with it: the shorter sentences' decoders attend their padding (the
GRU's zero outputs past each length, pad_packed_sequence's). The fix fills `masked_fill(mask == 0, -1e10)`.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD, SOS, SRC_VOCAB, TRG_VOCAB, EMB, HID = 0, 1, 30, 25, 16, 24


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(SRC_VOCAB, EMB, padding_idx=PAD)
        self.rnn = nn.GRU(EMB, HID, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(2 * HID, HID)

    def forward(self, src, src_len):
        packed = pack_padded_sequence(self.embedding(src), src_len, batch_first=True, enforce_sorted=False)
        outputs, hidden = self.rnn(packed)
        outputs, _ = pad_packed_sequence(outputs, batch_first=True)
        hidden = torch.tanh(self.fc(torch.cat((hidden[-2], hidden[-1]), dim=1)))
        return outputs, hidden


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(2 * HID + HID, HID)
        self.v = nn.Linear(HID, 1, bias=False)

    def forward(self, hidden, encoder_outputs, mask):
        src_len = encoder_outputs.shape[1]
        hidden = hidden.unsqueeze(1).repeat(1, src_len, 1)
        energy = torch.tanh(self.attn(torch.cat((hidden, encoder_outputs), dim=2)))
        attention = self.v(energy).squeeze(2)
        if FIXED:
            attention = attention.masked_fill(mask == 0, -1e10)
        return F.softmax(attention, dim=1)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.embedding = nn.Embedding(TRG_VOCAB, EMB)
        self.rnn = nn.GRU(2 * HID + EMB, HID, batch_first=True)
        self.fc_out = nn.Linear(2 * HID + HID + EMB, TRG_VOCAB)

    def forward(self, token, hidden, encoder_outputs, mask):
        embedded = self.embedding(token).unsqueeze(1)
        a = self.attention(hidden, encoder_outputs, mask)
        weighted = (a.unsqueeze(2) * encoder_outputs).sum(dim=1, keepdim=True)
        output, hidden = self.rnn(torch.cat((embedded, weighted), dim=2), hidden.unsqueeze(0))
        prediction = self.fc_out(torch.cat((output, weighted, embedded), dim=2).squeeze(1))
        return prediction, hidden.squeeze(0)


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = Encoder(), Decoder()

    def make_src_mask(self, src):
        return src != PAD

    def forward(self, src, src_len, max_len=5):
        encoder_outputs, hidden = self.encoder(src, src_len)
        mask = self.make_src_mask(src)
        token = torch.full((src.shape[0],), SOS, dtype=torch.long)
        outputs = []
        for _ in range(max_len):
            prediction, hidden = self.decoder(token, hidden, encoder_outputs, mask)
            outputs.append(prediction)
            token = prediction.argmax(1)
        return torch.stack(outputs, dim=1)


model = Seq2Seq().eval()
lengths = [7, 4, 2]
src = torch.full((3, 7), PAD, dtype=torch.long)
for row, n in enumerate(lengths):
    src[row, :n] = torch.randint(2, SRC_VOCAB, (n,))
with torch.no_grad():
    logits = model(src, torch.tensor(lengths))
print("greedy:", logits.argmax(-1).tolist())
print("row 2 step 0:", [round(x, 4) for x in logits[2, 0, :4].tolist()])
