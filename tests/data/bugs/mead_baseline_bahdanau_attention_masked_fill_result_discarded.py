# mead-baseline (mead-ml/mead-baseline#223, commit da1e8c2): in the PyTorch seq2seq RNNDecoderWithAttn, BahdanauAttention
# called `a.masked_fill(keys_mask == 0, -1e9)` without keeping the result, so the source padding mask was never applied
# and batched decoding attended to padded encoder positions; the fix assigns `a = a.masked_fill(...)`.
import sys
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


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


class StackedLSTMCell(nn.Module):
    def __init__(self, num_layers, input_size, rnn_size, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.num_layers = num_layers
        self.layers = nn.ModuleList()
        for i in range(num_layers):
            self.layers.append(nn.LSTMCell(input_size=input_size, hidden_size=rnn_size, bias=False))
            input_size = rnn_size

    def forward(self, input, hidden):
        h_0, c_0 = hidden
        hs, cs = [], []
        for i, layer in enumerate(self.layers):
            h_i, c_i = layer(input, (h_0[i], c_0[i]))
            input = h_i
            if i != self.num_layers - 1:
                input = self.dropout(input)
            hs.append(h_i)
            cs.append(c_i)
        return input, (torch.stack(hs), torch.stack(cs))


class BaseAttention(nn.Module):
    def __init__(self, hsz):
        super().__init__()
        self.hsz = hsz
        self.W_c = nn.Linear(2 * self.hsz, hsz, bias=False)

    def forward(self, query_t, keys_bth, values_bth, keys_mask=None):
        a = self._attention(query_t, keys_bth, keys_mask)
        attended = self._update(a, query_t, values_bth)
        return attended

    def _update(self, a, query_t, values_bth):
        # (B x 1 x T) (B x T x H) = (B x 1 x H)
        a = a.view(a.size(0), 1, a.size(1))
        c_t = torch.bmm(a, values_bth).squeeze(1)
        attended = torch.cat([c_t, query_t], -1)
        attended = torch.tanh(self.W_c(attended))
        return attended


class BahdanauAttention(BaseAttention):
    def __init__(self, hsz):
        super().__init__(hsz)
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


RNNEncoderOutput = namedtuple("RNNEncoderOutput", ("output", "hidden", "src_mask"))


def _make_src_mask(output, lengths):
    T = output.shape[1]
    src_mask = sequence_mask(lengths, T).type_as(lengths.data)
    return src_mask


class RNNEncoder(nn.Module):
    def __init__(self, dsz, hsz, layers=1):
        super().__init__()
        self.rnn = nn.LSTM(dsz, hsz, layers)  # rnntype='lstm'
        self.src_mask_fn = _make_src_mask

    def forward(self, btc, lengths):
        tbc = btc.transpose(0, 1)
        packed = torch.nn.utils.rnn.pack_padded_sequence(tbc, lengths.tolist())
        output, hidden = self.rnn(packed)
        output, _ = torch.nn.utils.rnn.pad_packed_sequence(output)
        output = output.transpose(0, 1)
        return RNNEncoderOutput(output=output, hidden=hidden, src_mask=self.src_mask_fn(output, lengths))


class TransferLastHiddenPolicy(nn.Module):
    def forward(self, encoder_output, hsz, beam_width=1):
        h_i = encoder_output.hidden
        context = encoder_output.output
        batch_size = context.shape[0]
        init_zeros = context.data.new(batch_size, hsz).zero_()
        return h_i, init_zeros, context


class RNNDecoderWithAttn(nn.Module):
    """baseline.pytorch.seq2seq.decoders.RNNDecoder + RNNDecoderWithAttn (feed_input=True, attn_type='bahdanau')."""

    def __init__(self, tgt_embeddings, hsz, layers=1):
        super().__init__()
        self.hsz = hsz
        self.arc_policy = TransferLastHiddenPolicy()
        self.tgt_embeddings = tgt_embeddings
        dsz = tgt_embeddings.embedding_dim + self.hsz
        self.decoder_rnn = StackedLSTMCell(layers, dsz, self.hsz, 0.0)
        self.dropout = nn.Dropout(0.0)
        self.attn_module = BahdanauAttention(self.hsz)
        self.preds = nn.Linear(self.hsz, tgt_embeddings.num_embeddings)

    @staticmethod
    def input_i(embed_i, attn_output_i):
        embed_i = embed_i.squeeze(0)
        return torch.cat([embed_i, attn_output_i], 1)

    def forward(self, encoder_outputs, dst):
        src_mask = encoder_outputs.src_mask
        h_i, output_i, context_bth = self.arc_policy(encoder_outputs, self.hsz)
        output_tbh, _ = self.decode_rnn(context_bth, h_i, output_i, dst.transpose(0, 1), src_mask)
        pred = self.output(output_tbh)
        return pred.transpose(0, 1).contiguous()

    def decode_rnn(self, context_bth, h_i, output_i, dst_tbh, src_mask):
        embed_out_tbh = self.tgt_embeddings(dst_tbh)
        outputs = []
        for i, embed_i in enumerate(embed_out_tbh.split(1)):
            embed_i = self.input_i(embed_i, output_i)
            output_i, h_i = self.decoder_rnn(embed_i, h_i)
            output_i = self.attn(output_i, context_bth, src_mask)
            output_i = self.dropout(output_i)
            outputs.append(output_i)
        outputs_tbh = torch.stack(outputs)
        return outputs_tbh, h_i

    def attn(self, output_t, context, src_mask=None):
        return self.attn_module(output_t, context, context, src_mask)

    def output(self, x):
        pred = F.log_softmax(self.preds(x.view(x.size(0) * x.size(1), -1)), dim=-1)
        return pred.view(x.size(0), x.size(1), -1)


class Seq2SeqModel(nn.Module):
    """EncoderDecoderModelBase.forward: encode(src, src_len) then decode(encoder_outputs, dst)."""

    def __init__(self, vsz=20, dsz=16, hsz=32):
        super().__init__()
        self.src_embed = nn.Embedding(vsz, dsz, padding_idx=0)
        self.encoder = RNNEncoder(dsz, hsz)
        self.decoder = RNNDecoderWithAttn(nn.Embedding(vsz, dsz, padding_idx=0), hsz)

    def forward(self, input):
        encoder_outputs = self.encoder(self.src_embed(input["src"]), input["src_len"])
        return self.decoder(encoder_outputs, input["dst"])


model = Seq2SeqModel().eval()
PAD, GO = 0, 1
# make_input sorts the batch by source length, descending
src_len = torch.tensor([8, 5, 3])
src = torch.randint(4, 20, (3, 8))
for b, L in enumerate(src_len.tolist()):
    src[b, L:] = PAD
dst = torch.cat([torch.full((3, 1), GO), torch.randint(4, 20, (3, 5))], dim=1)

with torch.no_grad():
    batched = model({"src": src, "src_len": src_len, "dst": dst})
    diff = 0.0
    for b, L in enumerate(src_len.tolist()):
        alone = model({"src": src[b:b + 1, :L], "src_len": src_len[b:b + 1], "dst": dst[b:b + 1]})
        diff = max(diff, (batched[b] - alone[0]).abs().max().item())
print(f"max |batched log-probs - per-sentence log-probs| = {diff:.6f}")
