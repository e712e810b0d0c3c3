# OpenNMT/OpenNMT-py#272: GlobalAttention.applyMask was never called, so the RNN decoder's attention over the
# encoder memory also attended to source padding; batched translation differed from batch size 1.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
PAD = 0


class GlobalAttention(nn.Module):
    """Luong "general" attention over the source memory bank."""

    def __init__(self, dim):
        super().__init__()
        self.linear_in = nn.Linear(dim, dim, bias=False)
        self.linear_out = nn.Linear(dim * 2, dim, bias=False)
        self.sm = nn.Softmax(dim=-1)
        self.tanh = nn.Tanh()
        self.mask = None

    def applyMask(self, mask):
        self.mask = mask

    def score(self, h_t, h_s):
        h_t_ = self.linear_in(h_t)
        return torch.bmm(h_t_, h_s.transpose(1, 2))

    def forward(self, input, context):
        # input: batch x tgt_len x dim, context: batch x src_len x dim
        batch, sourceL, dim = context.size()
        targetL = input.size(1)
        align = self.score(input, context)
        if self.mask is not None:
            mask_ = self.mask.view(batch, 1, sourceL)
            align = align.masked_fill(mask_, -float("inf"))
        align_vectors = self.sm(align.view(batch * targetL, sourceL)).view(batch, targetL, sourceL)
        c = torch.bmm(align_vectors, context)
        attn_h = self.tanh(self.linear_out(torch.cat([c, input], 2)))
        return attn_h, align_vectors


class Encoder(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.rnn = nn.LSTM(dim, dim, batch_first=True)

    def forward(self, src, lengths):
        emb = self.embeddings(src)
        packed = nn.utils.rnn.pack_padded_sequence(emb, lengths, batch_first=True, enforce_sorted=False)
        out, hidden = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=src.size(1))
        return hidden, out


class Decoder(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.rnn = nn.LSTM(dim, dim, batch_first=True)
        self.attn = GlobalAttention(dim)

    def forward(self, tgt, hidden, context):
        emb = self.embeddings(tgt)
        out, hidden = self.rnn(emb, hidden)
        attn_h, attn = self.attn(out, context)
        return attn_h, attn


class NMTModel(nn.Module):
    def __init__(self, vocab=30, dim=16):
        super().__init__()
        self.encoder = Encoder(vocab, dim)
        self.decoder = Decoder(vocab, dim)
        self.generator = nn.Linear(dim, vocab)

    def forward(self, src, tgt, lengths):
        enc_hidden, context = self.encoder(src, lengths)
        if FIXED:
            # mask source padding in the decoder's attention over the memory bank
            self.decoder.attn.applyMask(src.eq(PAD))
        out, attn = self.decoder(tgt, enc_hidden, context)
        return self.generator(out), attn


def main():
    torch.manual_seed(0)
    model = NMTModel().eval()
    src = torch.randint(1, 30, (2, 7))
    lengths = torch.tensor([7, 4])
    src[1, 4:] = PAD  # second sentence is shorter, right-padded
    tgt = torch.randint(1, 30, (2, 5))
    with torch.no_grad():
        batched, attn = model(src, tgt, lengths)
        model.decoder.attn.mask = None
        alone, _ = model(src[1:, :4], tgt[1:], lengths[1:])
    print("attention weight on source padding:", attn[1, :, 4:].sum(-1).max().item())
    print("max |logits(batched) - logits(alone)| for the short sentence:", (batched[1] - alone[0]).abs().max().item())


if __name__ == "__main__":
    main()
