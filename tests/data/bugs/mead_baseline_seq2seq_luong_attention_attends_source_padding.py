# mead-ml/mead-baseline#20: the PyTorch Seq2SeqAttnModel's Luong attention took a softmax over
# every encoder output of the padded source batch, so the decoder attended to <PAD> positions
# of shorter sources; the fix masks the scores with keys_mask (src_mask) before the softmax.
# (The same PR also packed the encoder RNN; that part is kept in both modes here.)
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def sequence_mask(lengths, max_len):
    return torch.arange(max_len)[None, :] < lengths[:, None]


class LuongDotProductAttention(nn.Module):
    def __init__(self, hsz):
        super().__init__()
        self.hsz = hsz
        self.softmax = nn.Softmax(dim=1)
        self.W_c = nn.Linear(2 * hsz, hsz, bias=False)

    def forward(self, query_t, keys_bth, values_bth, keys_mask=None):
        a = self._attention(query_t, keys_bth, keys_mask)
        return self._update(a, query_t, values_bth)

    def _attention(self, query_t, keys_bth, keys_mask):
        a = torch.bmm(keys_bth, query_t.unsqueeze(2)).squeeze(2)
        if FIXED:
            a = a.masked_fill(keys_mask == 0, -1e9)
        a = self.softmax(a)
        return a

    def _update(self, a, query_t, values_bth):
        a = a.view(a.size(0), 1, a.size(1))
        c_t = torch.bmm(a, values_bth).squeeze(1)
        attended = torch.cat([c_t, query_t], 1)
        return torch.tanh(self.W_c(attended))


class Seq2SeqAttnModel(nn.Module):
    def __init__(self, vin=40, vout=30, dsz=16, hsz=32):
        super().__init__()
        self.hsz = hsz
        self.src_embed = nn.Embedding(vin, dsz, padding_idx=0)
        self.dst_embed = nn.Embedding(vout, dsz, padding_idx=0)
        self.encoder_rnn = nn.LSTM(dsz, hsz)
        self.decoder_rnn = nn.LSTMCell(hsz + dsz, hsz)
        self.attn_module = LuongDotProductAttention(hsz)
        self.preds = nn.Linear(hsz, vout)

    def encode(self, src, src_len):
        embed_in = self.src_embed(src)  # T x B x D
        packed = nn.utils.rnn.pack_padded_sequence(embed_in, src_len, enforce_sorted=False)
        output, hidden = self.encoder_rnn(packed)
        output, _ = nn.utils.rnn.pad_packed_sequence(output, total_length=src.size(0))
        return output.transpose(0, 1), hidden  # context: B x T x H

    def attn(self, output_t, context, src_mask=None):
        return self.attn_module(output_t, context, context, src_mask)

    def forward(self, src, src_len, dst):
        context, (h, c) = self.encode(src, src_len)
        src_mask = sequence_mask(src_len, src.size(0))
        h_i, c_i = h[-1], c[-1]
        output_i = torch.zeros(src.size(1), self.hsz)
        outputs = []
        for embed_i in self.dst_embed(dst):  # teacher forcing, time-major
            h_i, c_i = self.decoder_rnn(torch.cat([embed_i, output_i], 1), (h_i, c_i))
            output_i = self.attn(h_i, context, src_mask)
            outputs.append(output_i)
        return F.log_softmax(self.preds(torch.stack(outputs)), dim=-1)


model = Seq2SeqAttnModel().eval()
src_len = torch.tensor([9, 4])
src = torch.randint(1, 40, (9, 2))
src[4:, 1] = 0  # second source is padded
dst = torch.randint(1, 30, (6, 2))

with torch.no_grad():
    batched = model(src, src_len, dst)[:, 1]
    alone = model(src[:4, 1:], src_len[1:], dst[:, 1:])[:, 0]  # same sentence, no padding

print(f"fixed={FIXED} max |log-probs in padded batch - alone| = {(batched - alone).abs().max():.4e}")
