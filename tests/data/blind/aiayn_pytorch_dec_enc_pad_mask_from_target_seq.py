# Citation: jadore801120/attention-is-all-you-need-pytorch, commit 94aae68
#   ("fix wrong q/k pair", 2017-06-25); buggy parent 94aae68^.
# Upstream: transformer/Models.py get_attn_padding_mask / Decoder.forward,
#   transformer/SubLayers.py MultiHeadAttention, transformer/Modules.py
#   ScaledDotProductAttention (masked_fill_ with -inf).
# Bug: Decoder.forward built the decoder->encoder attention mask as
#   get_attn_padding_mask(src_seq, tgt_seq): the padding pattern of the *target*
#   sequence, laid on the source-key axis.  When the padded source length equals
#   the (shifted) target length the shapes line up and it runs silently: source
#   keys are hidden wherever the target happens to be padded, and real source
#   padding stays visible to the cross-attention.
# Fix: get_attn_padding_mask(tgt_seq, src_seq) (query = target, key = source).
# Port notes: modern torch (no Variable, xavier_normal_), LayerNormalization applied
#   per position (BottleLayerNormalization, the upstream fix of the next day 9998386),
#   tiny sizes, dropout 0.
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.init as init

FIXED = "--fixed" in sys.argv

# ---------------------------------------------------------------- Constants.py
PAD = 0
UNK = 1
BOS = 2
EOS = 3


# ---------------------------------------------------------------- Modules.py
class Linear(nn.Module):
    ''' Simple Linear layer with xavier init '''
    def __init__(self, d_in, d_out, bias=True):
        super(Linear, self).__init__()
        self.linear = nn.Linear(d_in, d_out, bias=bias)
        init.xavier_normal_(self.linear.weight)

    def forward(self, x):
        return self.linear(x)


class Bottle(nn.Module):
    ''' Perform the reshape routine before and after an operation '''

    def forward(self, input):
        if len(input.size()) <= 2:
            return super(Bottle, self).forward(input)
        size = input.size()[:2]
        out = super(Bottle, self).forward(input.reshape(size[0] * size[1], -1))
        return out.view(size[0], size[1], -1)


class BottleLinear(Bottle, Linear):
    pass


class LayerNormalization(nn.Module):
    ''' Layer normalization module '''

    def __init__(self, d_hid, eps=1e-3):
        super(LayerNormalization, self).__init__()
        self.eps = eps
        self.a_2 = nn.Parameter(torch.ones(d_hid), requires_grad=True)
        self.b_2 = nn.Parameter(torch.zeros(d_hid), requires_grad=True)

    def forward(self, z):
        if z.size(1) == 1:
            return z
        mu = torch.mean(z, dim=1, keepdim=True)
        sigma = torch.std(z, dim=1, keepdim=True)
        ln_out = (z - mu.expand_as(z)) / (sigma.expand_as(z) + self.eps)
        ln_out = ln_out * self.a_2.expand_as(ln_out) + self.b_2.expand_as(ln_out)
        return ln_out


class BottleLayerNormalization(Bottle, LayerNormalization):
    pass


class ScaledDotProductAttention(nn.Module):
    ''' Scaled Dot-Product Attention '''

    def __init__(self, d_model, attn_dropout=0.0):
        super(ScaledDotProductAttention, self).__init__()
        self.temper = np.power(d_model, 0.5)
        self.dropout = nn.Dropout(attn_dropout)
        self.softmax = nn.Softmax(dim=1)

    def forward(self, q, k, v, attn_mask=None):
        _, len_q, _ = q.size()
        _, len_k, _ = k.size()

        attn = torch.bmm(q, k.transpose(1, 2)) / self.temper

        if attn_mask is not None:
            attn.data.masked_fill_(attn_mask, -float('inf'))

        attn = self.softmax(attn.view(-1, len_k)).view(-1, len_q, len_k)
        attn = self.dropout(attn)
        output = torch.bmm(attn, v)
        return output, attn


# ---------------------------------------------------------------- SubLayers.py
class MultiHeadAttention(nn.Module):
    ''' Multi-Head Attention module '''

    def __init__(self, n_head, d_model, d_k, d_v, dropout=0.0):
        super(MultiHeadAttention, self).__init__()
        self.n_head = n_head
        self.d_k = d_k
        self.d_v = d_v

        self.w_qs = nn.Parameter(torch.FloatTensor(n_head, d_model, d_k))
        self.w_ks = nn.Parameter(torch.FloatTensor(n_head, d_model, d_k))
        self.w_vs = nn.Parameter(torch.FloatTensor(n_head, d_model, d_v))

        self.attention = ScaledDotProductAttention(d_model)
        self.layer_norm = BottleLayerNormalization(d_model)
        self.proj = BottleLinear(n_head * d_v, d_model)
        self.dropout = nn.Dropout(dropout)

        init.xavier_normal_(self.w_qs)
        init.xavier_normal_(self.w_ks)
        init.xavier_normal_(self.w_vs)

    def forward(self, q, k, v, attn_mask=None):
        d_k, d_v = self.d_k, self.d_v
        n_head = self.n_head

        residual = q

        mb_size, len_q, d_model = q.size()
        mb_size, len_k, d_model = k.size()
        mb_size, len_v, d_model = v.size()

        # treat as a (n_head) size batch
        q_s = q.repeat(n_head, 1, 1).view(n_head, -1, d_model)
        k_s = k.repeat(n_head, 1, 1).view(n_head, -1, d_model)
        v_s = v.repeat(n_head, 1, 1).view(n_head, -1, d_model)

        # treat the result as a (n_head * mb_size) size batch
        q_s = torch.bmm(q_s, self.w_qs).view(-1, len_q, d_k)
        k_s = torch.bmm(k_s, self.w_ks).view(-1, len_k, d_k)
        v_s = torch.bmm(v_s, self.w_vs).view(-1, len_v, d_v)

        outputs, attns = self.attention(q_s, k_s, v_s, attn_mask=attn_mask.repeat(n_head, 1, 1))

        # back to original mb_size batch (as upstream wrote it at this commit)
        outputs = outputs.view(mb_size, len_q, -1)

        outputs = self.proj(outputs)
        outputs = self.dropout(outputs)

        return self.layer_norm(outputs + residual), attns


class PositionwiseFeedForward(nn.Module):
    ''' A two-feed-forward-layer module '''

    def __init__(self, d_hid, d_inner_hid, dropout=0.0):
        super(PositionwiseFeedForward, self).__init__()
        self.w_1 = nn.Conv1d(d_hid, d_inner_hid, 1)
        self.w_2 = nn.Conv1d(d_inner_hid, d_hid, 1)
        self.layer_norm = BottleLayerNormalization(d_hid)
        self.dropout = nn.Dropout(dropout)
        self.relu = nn.ReLU()

    def forward(self, x):
        residual = x
        output = self.relu(self.w_1(x.transpose(1, 2)))
        output = self.w_2(output).transpose(2, 1)
        output = self.dropout(output)
        return self.layer_norm(output + residual)


# ---------------------------------------------------------------- Layers.py
class EncoderLayer(nn.Module):
    def __init__(self, d_model, d_inner_hid, n_head, d_k, d_v, dropout=0.0):
        super(EncoderLayer, self).__init__()
        self.slf_attn = MultiHeadAttention(n_head, d_model, d_k, d_v, dropout=dropout)
        self.pos_ffn = PositionwiseFeedForward(d_model, d_inner_hid, dropout=dropout)

    def forward(self, enc_input, slf_attn_mask=None):
        enc_output, enc_slf_attn = self.slf_attn(
            enc_input, enc_input, enc_input, attn_mask=slf_attn_mask)
        enc_output = self.pos_ffn(enc_output)
        return enc_output, enc_slf_attn


class DecoderLayer(nn.Module):
    def __init__(self, d_model, d_inner_hid, n_head, d_k, d_v, dropout=0.0):
        super(DecoderLayer, self).__init__()
        self.slf_attn = MultiHeadAttention(n_head, d_model, d_k, d_v, dropout=dropout)
        self.enc_attn = MultiHeadAttention(n_head, d_model, d_k, d_v, dropout=dropout)
        self.pos_ffn = PositionwiseFeedForward(d_model, d_inner_hid, dropout=dropout)

    def forward(self, dec_input, enc_output, slf_attn_mask=None, dec_enc_attn_mask=None):
        dec_output, dec_slf_attn = self.slf_attn(
            dec_input, dec_input, dec_input, attn_mask=slf_attn_mask)
        dec_output, dec_enc_attn = self.enc_attn(
            dec_output, enc_output, enc_output, attn_mask=dec_enc_attn_mask)
        dec_output = self.pos_ffn(dec_output)
        return dec_output, dec_slf_attn, dec_enc_attn


# ---------------------------------------------------------------- Models.py
def position_encoding_init(n_position, d_pos_vec):
    ''' Init the sinusoid position encoding table '''
    position_enc = np.array([
        [pos / np.power(10000, 2 * i / d_pos_vec) for i in range(d_pos_vec)]
        if pos != 0 else np.zeros(d_pos_vec) for pos in range(n_position)])
    position_enc[1:, 0::2] = np.sin(position_enc[1:, 0::2])
    position_enc[1:, 1::2] = np.cos(position_enc[1:, 1::2])
    return torch.from_numpy(position_enc).type(torch.FloatTensor)


def get_attn_padding_mask(seq_q, seq_k):
    ''' Indicate the padding-related part to mask '''
    assert seq_q.dim() == 2 and seq_k.dim() == 2
    mb_size, len_q = seq_q.size()
    mb_size, len_k = seq_k.size()
    pad_attn_mask = seq_k.data.eq(PAD).unsqueeze(1)               # bx1xsk
    pad_attn_mask = pad_attn_mask.expand(mb_size, len_q, len_k)  # bxsqxsk
    return pad_attn_mask


def get_attn_subsequent_mask(seq):
    ''' Get an attention mask to avoid using the subsequent info.'''
    assert seq.dim() == 2
    attn_shape = (seq.size(0), seq.size(1), seq.size(1))
    subsequent_mask = np.triu(np.ones(attn_shape), k=1).astype('uint8')
    subsequent_mask = torch.from_numpy(subsequent_mask)
    return subsequent_mask


class Encoder(nn.Module):
    def __init__(self, n_src_vocab, n_max_seq, n_layers=2, n_head=2, d_k=8, d_v=8,
                 d_word_vec=16, d_model=16, d_inner_hid=32, dropout=0.0):
        super(Encoder, self).__init__()
        n_position = n_max_seq + 1
        self.n_max_seq = n_max_seq
        self.d_model = d_model

        self.position_enc = nn.Embedding(n_position, d_word_vec, padding_idx=PAD)
        self.position_enc.weight.data = position_encoding_init(n_position, d_word_vec)
        self.src_word_emb = nn.Embedding(n_src_vocab, d_word_vec, padding_idx=PAD)
        self.layer_stack = nn.ModuleList([
            EncoderLayer(d_model, d_inner_hid, n_head, d_k, d_v, dropout=dropout)
            for _ in range(n_layers)])

    def forward(self, src_seq, src_pos):
        enc_input = self.src_word_emb(src_seq)
        enc_input += self.position_enc(src_pos)
        enc_outputs, enc_slf_attns = [], []

        enc_output = enc_input
        enc_slf_attn_mask = get_attn_padding_mask(src_seq, src_seq)
        for enc_layer in self.layer_stack:
            enc_output, enc_slf_attn = enc_layer(enc_output, slf_attn_mask=enc_slf_attn_mask)
            enc_outputs += [enc_output]
            enc_slf_attns += [enc_slf_attn]
        return enc_outputs, enc_slf_attns


class Decoder(nn.Module):
    def __init__(self, n_tgt_vocab, n_max_seq, n_layers=2, n_head=2, d_k=8, d_v=8,
                 d_word_vec=16, d_model=16, d_inner_hid=32, dropout=0.0):
        super(Decoder, self).__init__()
        n_position = n_max_seq + 1
        self.n_max_seq = n_max_seq
        self.d_model = d_model

        self.position_enc = nn.Embedding(n_position, d_word_vec, padding_idx=PAD)
        self.position_enc.weight.data = position_encoding_init(n_position, d_word_vec)
        self.tgt_word_emb = nn.Embedding(n_tgt_vocab, d_word_vec, padding_idx=PAD)
        self.dropout = nn.Dropout(dropout)
        self.layer_stack = nn.ModuleList([
            DecoderLayer(d_model, d_inner_hid, n_head, d_k, d_v, dropout=dropout)
            for _ in range(n_layers)])

    def forward(self, tgt_seq, tgt_pos, src_seq, enc_outputs):
        dec_input = self.tgt_word_emb(tgt_seq)
        dec_input += self.position_enc(tgt_pos)

        dec_outputs, dec_slf_attns, dec_enc_attns = [], [], []

        dec_slf_attn_pad_mask = get_attn_padding_mask(tgt_seq, tgt_seq)
        dec_slf_attn_sub_mask = get_attn_subsequent_mask(tgt_seq)
        dec_slf_attn_mask = torch.gt(dec_slf_attn_pad_mask + dec_slf_attn_sub_mask, 0)

        if FIXED:
            dec_enc_attn_pad_mask = get_attn_padding_mask(tgt_seq, src_seq)
        else:
            dec_enc_attn_pad_mask = get_attn_padding_mask(src_seq, tgt_seq)

        dec_output = dec_input
        for dec_layer, enc_output in zip(self.layer_stack, enc_outputs):
            dec_output, dec_slf_attn, dec_enc_attn = dec_layer(
                dec_output, enc_output, slf_attn_mask=dec_slf_attn_mask,
                dec_enc_attn_mask=dec_enc_attn_pad_mask)
            dec_outputs += [dec_output]
            dec_slf_attns += [dec_slf_attn]
            dec_enc_attns += [dec_enc_attn]

        return dec_outputs, dec_slf_attns, dec_enc_attns


class Transformer(nn.Module):
    def __init__(self, n_src_vocab, n_tgt_vocab, n_max_seq, n_layers=2, n_head=2,
                 d_word_vec=16, d_model=16, d_inner_hid=32, d_k=8, d_v=8,
                 dropout=0.0, proj_share_weight=True, embs_share_weight=True):
        super(Transformer, self).__init__()
        self.encoder = Encoder(
            n_src_vocab, n_max_seq, n_layers=n_layers, n_head=n_head,
            d_word_vec=d_word_vec, d_model=d_model, d_inner_hid=d_inner_hid, dropout=dropout)
        self.decoder = Decoder(
            n_tgt_vocab, n_max_seq, n_layers=n_layers, n_head=n_head,
            d_word_vec=d_word_vec, d_model=d_model, d_inner_hid=d_inner_hid, dropout=dropout)
        self.tgt_word_proj = BottleLinear(d_model, n_tgt_vocab, bias=False)
        self.dropout = nn.Dropout(dropout)

        if proj_share_weight:
            assert d_model == d_word_vec
            self.tgt_word_proj.linear.weight = self.decoder.tgt_word_emb.weight

        if embs_share_weight:
            assert n_src_vocab == n_tgt_vocab
            self.encoder.src_word_emb.weight = self.decoder.tgt_word_emb.weight

    def forward(self, src, tgt):
        src_seq, src_pos = src
        tgt_seq, tgt_pos = tgt

        tgt_seq = tgt_seq[:, :-1]
        tgt_pos = tgt_pos[:, :-1]

        enc_outputs, enc_slf_attns = self.encoder(src_seq, src_pos)
        dec_outputs, dec_slf_attns, dec_enc_attns = self.decoder(
            tgt_seq, tgt_pos, src_seq, enc_outputs)
        dec_output = dec_outputs[-1]

        seq_logit = self.tgt_word_proj(dec_output)
        return seq_logit.view(-1, seq_logit.size(2))


# ---------------------------------------------------------------- DataLoader.py
def pad_to_longest(insts):
    ''' Pad the instance to the max seq length in batch '''
    max_len = max(len(inst) for inst in insts)
    inst_data = np.array([inst + [PAD] * (max_len - len(inst)) for inst in insts])
    inst_position = np.array([
        [pos_i + 1 if w_i != PAD else 0 for pos_i, w_i in enumerate(inst)]
        for inst in inst_data])
    return torch.LongTensor(inst_data), torch.LongTensor(inst_position)


# ---------------------------------------------------------------- train.py
def get_criterion(vocab_size):
    weight = torch.ones(vocab_size)
    weight[PAD] = 0
    return nn.CrossEntropyLoss(weight, reduction='sum')


def main():
    torch.manual_seed(0)
    np.random.seed(0)
    vocab = 14
    model = Transformer(vocab, vocab, n_max_seq=10)
    crit = get_criterion(vocab)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)

    # one batch of the training data: sentences of uneven lengths on both sides
    src_insts = [
        [BOS, 5, 6, 7, EOS],
        [BOS, 8, 9, 10, 11, EOS],
        [BOS, 12, EOS],
    ]
    tgt_insts = [
        [BOS, 9, 10, EOS],
        [BOS, 4, 5, 6, 7, 8, EOS],
        [BOS, 11, 12, 13, 4, EOS],
    ]
    src = pad_to_longest(src_insts)
    tgt = pad_to_longest(tgt_insts)
    gold = tgt[0][:, 1:]

    for step in range(3):
        optimizer.zero_grad()
        pred = model(src, tgt)
        loss = crit(pred, gold.contiguous().view(-1))
        loss.backward()
        optimizer.step()
        n_words = gold.ne(PAD).sum().item()
        print("step %d  loss/word %.6f" % (step, loss.item() / n_words))

    model.eval()
    with torch.no_grad():
        pred = model(src, tgt)
    print("logits[0, :4]:", [round(x, 5) for x in pred[0, :4].tolist()])
    print("logit sum (real target positions):",
          round(pred[gold.contiguous().view(-1).ne(PAD)].sum().item(), 5))


if __name__ == "__main__":
    main()
