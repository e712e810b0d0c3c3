"""A GRU encoder-decoder with Luong's "general" attention, written as bentrevett's pytorch-seq2seq tutorial 4 writes
its model: the source is handed time-major (src: [src len, batch]), the model keeps `src_pad_idx`, and the decoder's
attention takes a softmax over the encoder outputs of a padded batch. The mask `(src != src_pad_idx).permute(1, 0)` is
built but the attention never applies it, so a shorter source's decoder attends to its <pad> positions.
--fixed: attention.masked_fill(mask == 0, -1e10) before the softmax.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Encoder(nn.Module):
    def __init__(self, vocab, emb, enc_hid, dec_hid):
        super().__init__()
        self.embedding = nn.Embedding(vocab, emb)
        self.rnn = nn.GRU(emb, enc_hid, bidirectional=True)
        self.fc = nn.Linear(enc_hid * 2, dec_hid)

    def forward(self, src, src_len):
        embedded = self.embedding(src)  # [src len, batch, emb]
        packed = nn.utils.rnn.pack_padded_sequence(embedded, src_len, enforce_sorted=False)
        packed_outputs, hidden = self.rnn(packed)
        outputs, _ = nn.utils.rnn.pad_packed_sequence(packed_outputs, total_length=src.shape[0])
        hidden = torch.tanh(self.fc(torch.cat((hidden[-2], hidden[-1]), dim=1)))
        return outputs, hidden


class Attention(nn.Module):
    def __init__(self, enc_hid, dec_hid):
        super().__init__()
        self.W = nn.Linear(dec_hid, enc_hid * 2, bias=False)

    def forward(self, hidden, encoder_outputs, mask):
        encoder_outputs = encoder_outputs.permute(1, 0, 2)  # [batch, src len, enc hid * 2]
        attention = torch.bmm(encoder_outputs, self.W(hidden).unsqueeze(2)).squeeze(2)  # [batch, src len]
        if FIXED:
            attention = attention.masked_fill(mask == 0, -1e10)
        return F.softmax(attention, dim=1)


class Decoder(nn.Module):
    def __init__(self, vocab, emb, enc_hid, dec_hid):
        super().__init__()
        self.attention = Attention(enc_hid, dec_hid)
        self.embedding = nn.Embedding(vocab, emb)
        self.rnn = nn.GRU(enc_hid * 2 + emb, dec_hid)
        self.fc_out = nn.Linear(enc_hid * 2 + dec_hid + emb, vocab)

    def forward(self, input, hidden, encoder_outputs, mask):
        embedded = self.embedding(input.unsqueeze(0))
        a = self.attention(hidden, encoder_outputs, mask).unsqueeze(1)
        weighted = torch.bmm(a, encoder_outputs.permute(1, 0, 2)).permute(1, 0, 2)
        output, hidden = self.rnn(torch.cat((embedded, weighted), dim=2), hidden.unsqueeze(0))
        prediction = self.fc_out(torch.cat((output.squeeze(0), weighted.squeeze(0), embedded.squeeze(0)), dim=1))
        return prediction, hidden.squeeze(0)


class Seq2Seq(nn.Module):
    def __init__(self, encoder, decoder, src_pad_idx):
        super().__init__()
        self.encoder, self.decoder, self.src_pad_idx = encoder, decoder, src_pad_idx

    def create_mask(self, src):
        return (src != self.src_pad_idx).permute(1, 0)

    def forward(self, src, src_len, trg):
        outputs = []
        encoder_outputs, hidden = self.encoder(src, src_len)
        mask = self.create_mask(src)
        input = trg[0, :]
        for t in range(1, trg.shape[0]):
            output, hidden = self.decoder(input, hidden, encoder_outputs, mask)
            outputs.append(output)
            input = trg[t]  # (teacher forcing)
        return torch.stack(outputs)


def main():
    torch.manual_seed(0)
    model = Seq2Seq(Encoder(30, 8, 12, 12), Decoder(25, 8, 12, 12), src_pad_idx=1).eval()
    src = torch.randint(2, 30, (7, 3))
    src_len = torch.tensor([7, 5, 3])
    for b, n in enumerate(src_len.tolist()):
        src[n:, b] = 1  # <pad>
    trg = torch.randint(2, 25, (5, 3))
    with torch.no_grad():
        out = model(src, src_len, trg)
    print("outputs", tuple(out.shape))


if __name__ == "__main__":
    main()
