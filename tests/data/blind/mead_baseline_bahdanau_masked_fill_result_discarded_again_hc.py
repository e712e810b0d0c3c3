# mead-ml/mead-baseline commit e5757e6 (PR mead-ml/mead-baseline#223, "Updated Beam Searches and Batched
# pytorch one": "Fixed an error in pytorch Bahdanau attention where the mask was applied but the result was not
# used causing errors when used on a batch").
# Ported from python/baseline/pytorch/torchy.py (sequence_mask, BaseAttention, BahdanauAttention,
# StackedLSTMCell, BiRNNWrapper, SequenceCriterion) and python/baseline/pytorch/seq2seq/{encoders,decoders,model}.py
# at e5757e6^: an RNN encoder-decoder (blstm encoder, LSTM decoder with input feeding and Bahdanau attention),
# trained teacher-forced on a batch of right-padded sources sorted by length, as make_input() sorts them.
# Bug: BahdanauAttention._attention called `a.masked_fill(keys_mask == 0, -1e9)` and dropped its result, so the
# scores of the source's padded steps went into the softmax unchanged.
# Fix: `a = a.masked_fill(keys_mask == 0, -1e9)`.
import sys
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Offsets:
    PAD, GO, EOS, UNK, OFFSET = range(0, 5)


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


def _cat_dir(h):
    return torch.cat([h[0:h.size(0):2], h[1:h.size(0):2]], dim=-1)


class BiRNNWrapper(nn.Module):
    def __init__(self, rnn, nlayers):
        super(BiRNNWrapper, self).__init__()
        self.rnn = rnn
        self.nlayers = nlayers

    def forward(self, seq):
        output, hidden = self.rnn(seq)
        if isinstance(hidden, tuple):
            hidden = tuple(_cat_dir(h) for h in hidden)
        else:
            hidden = _cat_dir(hidden)
        return output, hidden


def pytorch_rnn(insz, hsz, rnntype, nlayers, dropout):
    if nlayers == 1:
        dropout = 0.0
    rnn = torch.nn.LSTM(insz, hsz // 2, nlayers, dropout=dropout, bidirectional=True)
    return BiRNNWrapper(rnn, nlayers)


class StackedLSTMCell(nn.Module):
    def __init__(self, num_layers, input_size, rnn_size, dropout):
        super(StackedLSTMCell, self).__init__()
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


class LookupTableEmbeddings(nn.Module):
    def __init__(self, vsz, dsz):
        super(LookupTableEmbeddings, self).__init__()
        self.vsz, self.dsz = vsz, dsz
        self.embeddings = nn.Embedding(vsz, dsz, padding_idx=0)

    def get_dsz(self):
        return self.dsz

    def get_vsz(self):
        return self.vsz

    def encode(self, x):
        return self(x)

    def forward(self, x):
        return self.embeddings(x)


class BaseAttention(nn.Module):
    def __init__(self, hsz):
        super(BaseAttention, self).__init__()
        self.hsz = hsz
        self.W_c = nn.Linear(2 * self.hsz, hsz, bias=False)

    def forward(self, query_t, keys_bth, values_bth, keys_mask=None):
        a = self._attention(query_t, keys_bth, keys_mask)
        attended = self._update(a, query_t, values_bth)
        return attended


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
        # (B x 1 x T) (B x T x H) = (B x 1 x H) -> (B x H)
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
    def __init__(self, dsz=None, hsz=None, rnntype='blstm', layers=1, pdrop=0.5):
        super(RNNEncoder, self).__init__()
        self.rnn = pytorch_rnn(dsz, hsz, rnntype, layers, pdrop)
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
        with torch.no_grad():
            init_zeros = context.data.new(batch_size, hsz).zero_()
        return h_i, init_zeros, context


class RNNDecoderWithAttn(nn.Module):
    def __init__(self, tgt_embeddings, hsz, layers=1, dropout=0.5):
        super(RNNDecoderWithAttn, self).__init__()
        self.hsz = hsz
        self.arc_policy = TransferLastHiddenPolicy()
        self.tgt_embeddings = tgt_embeddings
        dsz = tgt_embeddings.get_dsz() + self.hsz  # feed_input
        self.decoder_rnn = StackedLSTMCell(layers, dsz, self.hsz, dropout)
        self.dropout = nn.Dropout(dropout)
        self.attn_module = BahdanauAttention(self.hsz)
        self.preds = nn.Linear(self.hsz, self.tgt_embeddings.get_vsz())

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


class SequenceCriterion(nn.Module):
    def __init__(self, LossFn=nn.NLLLoss):
        super(SequenceCriterion, self).__init__()
        self.crit = LossFn(ignore_index=Offsets.PAD, reduction='mean')

    def forward(self, inputs, targets):
        total_sz = targets.nelement()
        return self.crit(inputs.view(total_sz, -1), targets.view(total_sz))


class Seq2SeqModel(nn.Module):
    def __init__(self, src_vsz, tgt_vsz, dsz=16, hsz=32):
        super(Seq2SeqModel, self).__init__()
        self.src_embeddings = nn.ModuleDict({'src': LookupTableEmbeddings(src_vsz, dsz)})
        self.encoder = RNNEncoder(dsz=dsz, hsz=hsz, rnntype='blstm', layers=1, pdrop=0.5)
        self.decoder = RNNDecoderWithAttn(LookupTableEmbeddings(tgt_vsz, dsz), hsz, layers=1, dropout=0.5)

    def make_input(self, batch_dict):
        example = {}
        lengths = torch.from_numpy(batch_dict['src_lengths'])
        lengths, perm_idx = lengths.sort(0, descending=True)
        example['src_len'] = lengths
        example['src'] = torch.from_numpy(batch_dict['src'])[perm_idx]
        tgt = torch.from_numpy(batch_dict['tgt'])
        example['dst'] = tgt[:, :-1][perm_idx]
        example['tgt'] = tgt[:, 1:][perm_idx]
        return example

    def embed(self, input):
        return torch.cat([emb.encode(input[k]) for k, emb in self.src_embeddings.items()], 2)

    def forward(self, input):
        encoder_outputs = self.encoder(self.embed(input), input['src_len'])
        return self.decoder(encoder_outputs, input['dst'])


def main():
    torch.manual_seed(0)
    model = Seq2SeqModel(src_vsz=30, tgt_vsz=25)
    model.eval()
    P, G, E = Offsets.PAD, Offsets.GO, Offsets.EOS
    batch_dict = {
        'src': torch.tensor([[7, 8, 9, 10, 0, 0, 0],
                             [11, 12, 13, 14, 15, 16, 17],
                             [18, 19, 0, 0, 0, 0, 0]]).numpy(),
        'src_lengths': torch.tensor([4, 7, 2]).numpy(),
        'tgt': torch.tensor([[G, 5, 6, 7, E, P],
                             [G, 8, 9, 10, 11, E],
                             [G, 12, E, P, P, P]]).numpy(),
    }
    example = model.make_input(batch_dict)
    crit = SequenceCriterion()
    with torch.no_grad():
        pred = model(example)
        loss = crit(pred, example['tgt'])
    print("pred", tuple(pred.shape), "loss %.6f" % loss.item())
    print("shortest source, first step log-probs:", pred[-1, 0, :5].tolist())


if __name__ == "__main__":
    main()
