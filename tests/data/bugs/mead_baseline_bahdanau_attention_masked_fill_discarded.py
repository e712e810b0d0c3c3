"""mead-baseline: BahdanauAttention computes the source mask fill but throws the result away.

Citation: mead-ml/mead-baseline PR #223 ("Updated Beam Searches and Batched pytorch one.",
merged as commit da1e8c2d, 2019-01-14). The PR description lists the bug: "Fixed an error in pytorch
Bahdanau attention where the mask was applied but the result was not used causing errors when used on a
batch." The diff in python/baseline/pytorch/torchy.py changes `a.masked_fill(keys_mask == 0, -1e9)` to
`a = a.masked_fill(keys_mask == 0, -1e9)` in `BahdanauAttention._attention` (the Luong / scaled dot
product variants already assigned the result).

Bug: `Tensor.masked_fill` is out of place, so the attention energies over padded source positions are
never filled with -1e9; the softmax of the RNN decoder's attention spreads weight over the padded encoder
states (which `pad_packed_sequence` left at zero, so they still take a share) for every shorter sentence
in a batch.
Fix: assign the result of `masked_fill`.

This program follows the pre-fix code: `RNNEncoder` (packed BiLSTM-style RNN, `src_mask` from
`sequence_mask(lengths, T)` in an `RNNEncoderOutput` namedtuple) feeding `RNNDecoderWithAttn` with
`attn_type='bahdanau'` in its kwargs; the decoder runs teacher-forced over a batch of two source sentences
of lengths 6 and 3. `--fixed` assigns the masked energies.
"""
import sys
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def sequence_mask(lengths, max_len=-1):
    lens = lengths.cpu()
    if max_len < 0:
        max_len = torch.max(lens).item()
    # 1 x T
    row = torch.arange(0, max_len).type_as(lens).view(1, -1)
    # B x 1
    col = lens.view(-1, 1)
    # Broadcast to B x T, compares increasing number to max
    mask = row < col
    return mask


class BaseAttention(nn.Module):

    def __init__(self, hsz):
        super(BaseAttention, self).__init__()
        self.hsz = hsz
        self.W_c = nn.Linear(2 * self.hsz, hsz, bias=False)

    def forward(self, query_t, keys_bth, values_bth, keys_mask=None):
        a = self._attention(query_t, keys_bth, keys_mask)
        attended = self._update(a, query_t, values_bth)
        return attended

    def _attention(self, query_t, keys_bth, keys_mask):
        pass

    def _update(self, a, query_t, values_bth):
        a = a.view(a.size(0), 1, a.size(1))
        c_t = torch.bmm(a, values_bth).squeeze(1)
        attended = torch.cat([c_t, query_t], -1)
        attended = torch.tanh(self.W_c(attended))
        return attended


class LuongDotProductAttention(BaseAttention):

    def _attention(self, query_t, keys_bth, keys_mask):
        a = torch.bmm(keys_bth, query_t.unsqueeze(2))
        a = a.squeeze(2).masked_fill(keys_mask == 0, -1e9)
        a = F.softmax(a, dim=-1)
        return a


class BahdanauAttention(BaseAttention):

    def __init__(self, hsz):
        super(BahdanauAttention, self).__init__(hsz)
        self.hsz = hsz
        self.W_a = nn.Linear(self.hsz, self.hsz, bias=False)
        self.E_a = nn.Linear(self.hsz, self.hsz, bias=False)
        self.v = nn.Linear(self.hsz, 1, bias=False)

    def _attention(self, query_t, keys_bth, keys_mask):
        B, T, H = keys_bth.shape
        q = self.W_a(query_t.view(-1, self.hsz)).view(B, 1, H)
        u = self.E_a(keys_bth.contiguous().view(-1, self.hsz)).view(B, T, H)
        z = torch.tanh(q + u)
        a = self.v(z.view(-1, self.hsz)).view(B, T)
        if FIXED:
            a = a.masked_fill(keys_mask == 0, -1e9)
        else:
            a.masked_fill(keys_mask == 0, -1e9)
        a = F.softmax(a, dim=-1)
        return a

    def _update(self, a, query_t, values_bth):
        a = a.view(a.size(0), 1, a.size(1))
        c_t = torch.bmm(a, values_bth).squeeze(1)
        attended = torch.cat([c_t, query_t], -1)
        attended = self.W_c(attended)
        return attended


RNNEncoderOutput = namedtuple("RNNEncoderOutput", ("output", "hidden", "src_mask"))


def _make_src_mask(output, lengths):
    T = output.shape[1]
    src_mask = sequence_mask(lengths, T).type_as(lengths.data)
    return src_mask


class RNNEncoder(nn.Module):

    def __init__(self, dsz=None, hsz=None, layers=1, pdrop=0.0, create_src_mask=True, **kwargs):
        super(RNNEncoder, self).__init__()
        hidden = hsz if hsz is not None else dsz
        self.rnn = nn.LSTM(dsz, hidden, layers, dropout=pdrop)
        self.src_mask_fn = _make_src_mask if create_src_mask is True else lambda x, y: None

    def forward(self, btc, lengths):
        # Do all our RNN stuff as TBC
        tbc = btc.transpose(0, 1)
        packed = torch.nn.utils.rnn.pack_padded_sequence(tbc, lengths.tolist())
        output, hidden = self.rnn(packed)
        output, _ = torch.nn.utils.rnn.pad_packed_sequence(output)
        output = output.transpose(0, 1)
        return RNNEncoderOutput(output=output, hidden=hidden,
                                src_mask=self.src_mask_fn(output, lengths))


class RNNDecoderWithAttn(nn.Module):

    def __init__(self, tgt_vsz, hsz, **kwargs):
        super(RNNDecoderWithAttn, self).__init__()
        self.hsz = hsz
        self.tgt_embeddings = nn.Embedding(tgt_vsz, hsz)
        self.decoder_rnn = nn.LSTMCell(2 * hsz, hsz)  # input feeding
        self.preds = nn.Linear(hsz, tgt_vsz)
        self.init_attn(**kwargs)

    def init_attn(self, **kwargs):
        attn_type = kwargs.get('attn_type', 'bahdanau').lower()
        if attn_type == 'dot':
            self.attn_module = LuongDotProductAttention(self.hsz)
        else:
            self.attn_module = BahdanauAttention(self.hsz)

    def attn(self, output_t, context, src_mask=None):
        return self.attn_module(output_t, context, context, src_mask)

    def forward(self, encoder_outputs, dst):
        src_mask = encoder_outputs.src_mask
        h, c = encoder_outputs.hidden
        h_i = (h[-1], c[-1])
        output_i = torch.zeros_like(h_i[0])
        embed_out_tbh = self.tgt_embeddings(dst.transpose(0, 1))
        outputs = []
        for embed_i in embed_out_tbh.split(1):
            embed_i = torch.cat([embed_i.squeeze(0), output_i], 1)
            h_i = self.decoder_rnn(embed_i, h_i)
            output_i = self.attn(h_i[0], encoder_outputs.output, src_mask)
            outputs.append(output_i)
        return self.preds(torch.stack(outputs)).transpose(0, 1)


def main():
    torch.manual_seed(0)
    hsz, src_vsz, tgt_vsz = 16, 20, 20
    src_embed = nn.Embedding(src_vsz, hsz, padding_idx=0)
    encoder = RNNEncoder(dsz=hsz, hsz=hsz)
    decoder = RNNDecoderWithAttn(tgt_vsz, hsz, attn_type='bahdanau')
    # batch sorted by length for packing, as mead's seq2seq trainer does
    src = torch.tensor([[4, 7, 9, 3, 5, 2], [6, 8, 2, 0, 0, 0]])
    src_len = torch.tensor([6, 3])
    dst = torch.tensor([[1, 5, 6, 7], [1, 9, 4, 2]])
    with torch.no_grad():
        enc = encoder(src_embed(src), src_len)
        logits = decoder(enc, dst)
    print("fixed" if FIXED else "buggy", tuple(logits.shape), round(float(logits[1].abs().sum()), 4))


if __name__ == "__main__":
    main()
