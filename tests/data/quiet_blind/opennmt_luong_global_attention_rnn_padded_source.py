"""Luong "general" global attention of an RNN decoder over a padded source batch (OpenNMT-py style).

Follows OpenNMT/OpenNMT-py onmt/modules/global_attention.py (GlobalAttention.score / forward with
memory_lengths -> sequence_mask, ``align.masked_fill_(~mask, -float('inf'))`` in place) and
onmt/utils/misc.py sequence_mask. The encoder is a packed bidirectional LSTM; each target step attends
over the source positions < src_len of its own sentence and never over the pad tail.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


def sequence_mask(lengths, max_len=None):
    """True for real positions (lengths are per batch row)."""
    batch_size = lengths.numel()
    max_len = max_len or lengths.max()
    return (torch.arange(0, max_len, device=lengths.device)
            .type_as(lengths).repeat(batch_size, 1).lt(lengths.unsqueeze(1)))


class GlobalAttention(nn.Module):
    def __init__(self, dim, attn_type="general"):
        super().__init__()
        self.dim = dim
        self.attn_type = attn_type
        self.linear_in = nn.Linear(dim, dim, bias=False)
        self.linear_out = nn.Linear(dim * 2, dim, bias=False)

    def score(self, h_t, h_s):
        # h_t: [B, tgt_len, dim], h_s: [B, src_len, dim]
        h_t = self.linear_in(h_t)
        return torch.bmm(h_t, h_s.transpose(1, 2))

    def forward(self, source, memory_bank, memory_lengths=None):
        one_step = source.dim() == 2
        if one_step:
            source = source.unsqueeze(1)
        align = self.score(source, memory_bank)
        if memory_lengths is not None:
            mask = sequence_mask(memory_lengths, max_len=align.size(-1))
            mask = mask.unsqueeze(1)  # broadcast over target steps
            align.masked_fill_(~mask, -float("inf"))
        align_vectors = F.softmax(align, -1)
        c = torch.bmm(align_vectors, memory_bank)
        attn_h = torch.tanh(self.linear_out(torch.cat([c, source], 2)))
        if one_step:
            return attn_h.squeeze(1), align_vectors.squeeze(1)
        return attn_h, align_vectors


class RNNEncoder(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim, padding_idx=1)
        self.rnn = nn.LSTM(dim, dim // 2, batch_first=True, bidirectional=True)

    def forward(self, src, lengths):
        emb = self.embeddings(src)
        packed = pack_padded_sequence(emb, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, state = self.rnn(packed)
        memory_bank, _ = pad_packed_sequence(out, batch_first=True, total_length=src.size(1))
        return memory_bank


class InputFeedRNNDecoder(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim, padding_idx=1)
        self.rnn = nn.LSTMCell(dim * 2, dim)
        self.attn = GlobalAttention(dim)
        self.dim = dim

    def forward(self, tgt, memory_bank, memory_lengths):
        B = tgt.size(0)
        h = memory_bank.new_zeros(B, self.dim)
        c = memory_bank.new_zeros(B, self.dim)
        input_feed = memory_bank.new_zeros(B, self.dim)
        outs, aligns = [], []
        for t in range(tgt.size(1)):  # one step per target token, as the input-feed decoder does
            emb_t = self.embeddings(tgt[:, t])
            h, c = self.rnn(torch.cat([emb_t, input_feed], 1), (h, c))
            attn_h, p_attn = self.attn(h, memory_bank, memory_lengths=memory_lengths)
            input_feed = attn_h
            outs.append(attn_h)
            aligns.append(p_attn)
        return torch.stack(outs, 1), torch.stack(aligns, 1)


def main():
    torch.manual_seed(0)
    vocab, dim, pad = 20, 16, 1
    src_lengths = torch.tensor([7, 4, 5])
    src = torch.randint(2, vocab, (3, 7))
    for b, n in enumerate(src_lengths.tolist()):
        src[b, n:] = pad
    tgt = torch.randint(2, vocab, (3, 5))
    enc, dec = RNNEncoder(vocab, dim).eval(), InputFeedRNNDecoder(vocab, dim).eval()
    with torch.no_grad():
        memory_bank = enc(src, src_lengths)
        out, align = dec(tgt, memory_bank, src_lengths)
        for b, n in enumerate(src_lengths.tolist()):
            assert torch.all(align[b, :, n:] == 0)
            mb_alone = enc(src[b:b + 1, :n], src_lengths[b:b + 1])
            out_alone, _ = dec(tgt[b:b + 1], mb_alone, src_lengths[b:b + 1])
            assert torch.allclose(out[b], out_alone[0], atol=1e-5)
    print("opennmt luong attention ok", tuple(align.shape))


if __name__ == "__main__":
    main()
