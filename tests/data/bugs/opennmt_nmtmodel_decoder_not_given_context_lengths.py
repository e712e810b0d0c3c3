"""OpenNMT-py (2017) NMTModel.forward: the decoder's global attention is not given the source lengths.

Citation: OpenNMT/OpenNMT-py PR #486 ("Update Models.py", merged as 6eafb997; fix commit 53a0c424). The pre-fix
onmt/Models.py, onmt/modules/GlobalAttention.py and onmt/Utils.py were read at the parent of 53a0c424, and the
fix diff was read.

Bug: `NMTModel.forward(src, tgt, lengths)` encodes with `self.encoder(src, lengths)` (packed RNN), then calls
`self.decoder(tgt, context, enc_state)` without `context_lengths`. `GlobalAttention.forward` only masks the
scores when `context_lengths is not None` (`sequence_mask(context_lengths)`), so every decoder step of a shorter
source attends to the padded encoder states ("the hidden states with PAD as input are also included in the
attention models").

Fix: pass `context_lengths=lengths` to the decoder.

This program builds a condensed 2017 model (RNNEncoder LSTM, InputFeedRNNDecoder, dot GlobalAttention),
time-major as OpenNMT was, with a batch of two sources (lengths 5 and 3, padded with 1 = <blank>) and runs the
training forward. Modern-torch spellings: `~mask` for `1 - mask` on a bool mask, `nn.Softmax(dim=-1)`.
"""
import sys

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence as pack
from torch.nn.utils.rnn import pad_packed_sequence as unpack

FIXED = "--fixed" in sys.argv
PAD = 1


def sequence_mask(lengths, max_len=None):
    """
    Creates a boolean mask from sequence lengths.
    """
    batch_size = lengths.numel()
    max_len = max_len or lengths.max()
    return (torch.arange(0, max_len)
            .type_as(lengths)
            .repeat(batch_size, 1)
            .lt(lengths.unsqueeze(1)))


class GlobalAttention(nn.Module):
    def __init__(self, dim, attn_type="dot"):
        super(GlobalAttention, self).__init__()
        self.dim = dim
        self.attn_type = attn_type
        self.linear_out = nn.Linear(dim * 2, dim, bias=False)
        self.sm = nn.Softmax(dim=-1)
        self.tanh = nn.Tanh()

    def score(self, h_t, h_s):
        h_s_ = h_s.transpose(1, 2)
        # (batch, t_len, d) x (batch, d, s_len) --> (batch, t_len, s_len)
        return torch.bmm(h_t, h_s_)

    def forward(self, input, context, context_lengths=None):
        input = input.unsqueeze(1)  # one step
        batch, sourceL, dim = context.size()
        batch_, targetL, dim_ = input.size()

        # compute attention scores, as in Luong et al.
        align = self.score(input, context)

        if context_lengths is not None:
            mask = sequence_mask(context_lengths)
            mask = mask.unsqueeze(1)  # Make it broadcastable.
            align.data.masked_fill_(~mask, -float('inf'))

        # Softmax to normalize attention weights
        align_vectors = self.sm(align.view(batch * targetL, sourceL))
        align_vectors = align_vectors.view(batch, targetL, sourceL)

        c = torch.bmm(align_vectors, context)
        concat_c = torch.cat([c, input], 2).view(batch * targetL, dim * 2)
        attn_h = self.tanh(self.linear_out(concat_c).view(batch, targetL, dim))
        return attn_h.squeeze(1), align_vectors.squeeze(1)


class RNNEncoder(nn.Module):
    def __init__(self, embeddings, hidden_size):
        super(RNNEncoder, self).__init__()
        self.embeddings = embeddings
        self.rnn = nn.LSTM(input_size=embeddings.embedding_dim, hidden_size=hidden_size, num_layers=1)

    def forward(self, input, lengths=None, hidden=None):
        emb = self.embeddings(input)
        packed_emb = emb
        if lengths is not None:
            lengths = lengths.view(-1).tolist()
            packed_emb = pack(emb, lengths)
        outputs, hidden_t = self.rnn(packed_emb, hidden)
        if lengths is not None:
            outputs = unpack(outputs)[0]
        return hidden_t, outputs


class InputFeedRNNDecoder(nn.Module):
    def __init__(self, embeddings, hidden_size):
        super(InputFeedRNNDecoder, self).__init__()
        self.embeddings = embeddings
        self.hidden_size = hidden_size
        self.rnn = nn.LSTMCell(embeddings.embedding_dim + hidden_size, hidden_size)
        self.attn = GlobalAttention(hidden_size)

    def init_decoder_state(self, src, context, enc_hidden):
        h, c = enc_hidden
        return (h[-1], c[-1])

    def forward(self, input, context, state, context_lengths=None):
        emb = self.embeddings(input)
        hidden = state
        output = torch.zeros(emb.size(1), self.hidden_size)
        outputs, attns = [], {"std": []}
        for emb_t in emb.split(1):
            emb_t = emb_t.squeeze(0)
            emb_t = torch.cat([emb_t, output], 1)
            hidden = self.rnn(emb_t, hidden)
            rnn_output = hidden[0]
            attn_output, attn = self.attn(
                rnn_output,
                context.transpose(0, 1),
                context_lengths=context_lengths)
            output = attn_output
            outputs += [output]
            attns["std"] += [attn]
        return torch.stack(outputs), hidden, attns


class NMTModel(nn.Module):
    def __init__(self, encoder, decoder):
        super(NMTModel, self).__init__()
        self.encoder = encoder
        self.decoder = decoder

    def forward(self, src, tgt, lengths, dec_state=None):
        tgt = tgt[:-1]  # exclude last target from inputs
        enc_hidden, context = self.encoder(src, lengths)
        enc_state = self.decoder.init_decoder_state(src, context, enc_hidden)
        if FIXED:
            out, dec_state, attns = self.decoder(tgt, context,
                                                 enc_state if dec_state is None
                                                 else dec_state,
                                                 context_lengths=lengths)
        else:
            out, dec_state, attns = self.decoder(tgt, context,
                                                 enc_state if dec_state is None
                                                 else dec_state)
        return out, attns, dec_state


if __name__ == "__main__":
    torch.manual_seed(0)
    src_emb = nn.Embedding(12, 8, padding_idx=PAD)
    tgt_emb = nn.Embedding(12, 8, padding_idx=PAD)
    model = NMTModel(RNNEncoder(src_emb, 16), InputFeedRNNDecoder(tgt_emb, 16)).eval()
    # time-major [src_len x batch]; sources sorted by length as the 2017 iterator did
    src = torch.tensor([[4, 7], [5, 8], [6, 9], [10, PAD], [11, PAD]])
    lengths = torch.tensor([5, 3])
    tgt = torch.tensor([[2, 2], [4, 5], [6, 7], [3, 3]])
    with torch.no_grad():
        out, attns, _ = model(src, tgt, lengths)
    print("fixed" if FIXED else "buggy", tuple(out.shape),
          "pad weight of row 1:", f"{attns['std'][0][1, 3:].sum().item():.4f}")
