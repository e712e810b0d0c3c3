# vliu15/dialogue-seq2seq commit ef5ce06 ("Add masks to global attentiton distribution"), mask form settled in
# 8ddb1ce / dcfb4ff / 9b3aa6a. The Session module between the Transformer encoder and decoder ran an LSTM over the
# max-pooled encoder output and then a global attention whose distribution is a softmax over the source positions
# (nn.Softmax(dim=1)). The padded source positions (zeroed by non_pad_mask, score 0) stayed in that softmax, so the
# real positions' weights depended on how much padding the batch had, and so did ses_output, which the decoder
# cross-attends. Fix: pass non_pad_mask into the attention and set attn_distr[~non_pad_mask] = -inf before the
# softmax. (ef5ce06's first form, (1 - non_pad_mask) * -inf, is 0 * -inf = NaN on real tokens; the follow-up
# commits switched to the boolean fill ported here. The project cast the mask to uint8 under torch 1.0, where ~ on
# a ByteTensor was a logical not; .bool() keeps that meaning.)
# Ported from seq2seq/Models.py, Layers.py, SubLayers.py, Modules.py (bug state at ef5ce06^), tiny sizes, CPU.
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Constants:
    PAD = 0
    UNK = 1
    BOS = 2
    EOS = 3


def get_non_pad_mask(seq):
    assert seq.dim() == 2
    return seq.ne(Constants.PAD).type(torch.float).unsqueeze(-1)


def get_sinusoid_encoding_table(n_position, d_hid, padding_idx=None):
    ''' Sinusoid position encoding table '''

    def cal_angle(position, hid_idx):
        return position / np.power(10000, 2 * (hid_idx // 2) / d_hid)

    def get_posi_angle_vec(position):
        return [cal_angle(position, hid_j) for hid_j in range(d_hid)]

    sinusoid_table = np.array([get_posi_angle_vec(pos_i) for pos_i in range(n_position)])
    sinusoid_table[:, 0::2] = np.sin(sinusoid_table[:, 0::2])
    sinusoid_table[:, 1::2] = np.cos(sinusoid_table[:, 1::2])
    if padding_idx is not None:
        sinusoid_table[padding_idx] = 0.
    return torch.FloatTensor(sinusoid_table)


def get_attn_key_pad_mask(seq_k, seq_q):
    ''' For masking out the padding part of key sequence. '''
    len_q = seq_q.size(1)
    padding_mask = seq_k.eq(Constants.PAD)
    padding_mask = padding_mask.unsqueeze(1).expand(-1, len_q, -1)  # b x lq x lk
    return padding_mask


def get_subsequent_mask(seq):
    ''' For masking out the subsequent info. '''
    sz_b, len_s = seq.size()
    subsequent_mask = torch.triu(
        torch.ones((len_s, len_s), device=seq.device, dtype=torch.uint8), diagonal=1)
    subsequent_mask = subsequent_mask.unsqueeze(0).expand(sz_b, -1, -1)  # b x ls x ls
    return subsequent_mask


class ScaledDotProductAttention(nn.Module):
    def __init__(self, temperature, attn_dropout=0.1):
        super().__init__()
        self.temperature = temperature
        self.dropout = nn.Dropout(attn_dropout)
        self.softmax = nn.Softmax(dim=2)

    def forward(self, q, k, v, mask=None):
        attn = torch.bmm(q, k.transpose(1, 2))
        attn = attn / self.temperature
        if mask is not None:
            attn = attn.masked_fill(mask, -np.inf)
        attn = self.softmax(attn)
        attn = self.dropout(attn)
        output = torch.bmm(attn, v)
        return output, attn


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, d_model, d_k, d_v, dropout=0.1):
        super().__init__()
        self.n_head = n_head
        self.d_k = d_k
        self.d_v = d_v
        self.w_qs = nn.Linear(d_model, n_head * d_k)
        self.w_ks = nn.Linear(d_model, n_head * d_k)
        self.w_vs = nn.Linear(d_model, n_head * d_v)
        nn.init.normal_(self.w_qs.weight, mean=0, std=np.sqrt(2.0 / (d_model + d_k)))
        nn.init.normal_(self.w_ks.weight, mean=0, std=np.sqrt(2.0 / (d_model + d_k)))
        nn.init.normal_(self.w_vs.weight, mean=0, std=np.sqrt(2.0 / (d_model + d_v)))
        self.attention = ScaledDotProductAttention(temperature=np.power(d_k, 0.5))
        self.layer_norm = nn.LayerNorm(d_model)
        self.fc = nn.Linear(n_head * d_v, d_model)
        nn.init.xavier_normal_(self.fc.weight)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        d_k, d_v, n_head = self.d_k, self.d_v, self.n_head
        sz_b, len_q, _ = q.size()
        sz_b, len_k, _ = k.size()
        sz_b, len_v, _ = v.size()
        residual = q
        q = self.w_qs(q).view(sz_b, len_q, n_head, d_k)
        k = self.w_ks(k).view(sz_b, len_k, n_head, d_k)
        v = self.w_vs(v).view(sz_b, len_v, n_head, d_v)
        q = q.permute(2, 0, 1, 3).contiguous().view(-1, len_q, d_k)  # (n*b) x lq x dk
        k = k.permute(2, 0, 1, 3).contiguous().view(-1, len_k, d_k)  # (n*b) x lk x dk
        v = v.permute(2, 0, 1, 3).contiguous().view(-1, len_v, d_v)  # (n*b) x lv x dv
        mask = mask.repeat(n_head, 1, 1)  # (n*b) x .. x ..
        output, attn = self.attention(q, k, v, mask=mask)
        output = output.view(n_head, sz_b, len_q, d_v)
        output = output.permute(1, 2, 0, 3).contiguous().view(sz_b, len_q, -1)  # b x lq x (n*dv)
        output = self.dropout(self.fc(output))
        output = self.layer_norm(output + residual)
        return output, attn


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_in, d_hid, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Conv1d(d_in, d_hid, 1)
        self.w_2 = nn.Conv1d(d_hid, d_in, 1)
        self.layer_norm = nn.LayerNorm(d_in)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        residual = x
        output = x.transpose(1, 2)
        output = self.w_2(F.relu(self.w_1(output)))
        output = output.transpose(1, 2)
        output = self.dropout(output)
        output = self.layer_norm(output + residual)
        return output


class MultiplicativeAttention(nn.Module):
    ''' Multiplicative Attention layer '''

    def __init__(self, d_model, d_hidden):
        super().__init__()
        self.attn_weight = nn.Linear(d_hidden, d_model)
        self.softmax = nn.Softmax(dim=1)

    def forward(self, enc_output, ses_hidden, non_pad_mask=None):
        attn_vec = self.attn_weight(ses_hidden).unsqueeze(-1)
        attn_distr = torch.bmm(enc_output, attn_vec).repeat(1, 1, enc_output.size(-1))
        if FIXED:
            #- Compute attention distribution and fill pad values with 0
            attn_distr[~non_pad_mask] = float('-inf')
        attn_distr = self.softmax(attn_distr)
        return attn_distr


class EncoderLayer(nn.Module):
    def __init__(self, d_model, d_inner, n_head, d_k, d_v, dropout=0.1):
        super(EncoderLayer, self).__init__()
        self.slf_attn = MultiHeadAttention(n_head, d_model, d_k, d_v, dropout=dropout)
        self.pos_ffn = PositionwiseFeedForward(d_model, d_inner, dropout=dropout)

    def forward(self, enc_input, non_pad_mask=None, slf_attn_mask=None):
        enc_output, enc_slf_attn = self.slf_attn(enc_input, enc_input, enc_input, mask=slf_attn_mask)
        enc_output *= non_pad_mask
        enc_output = self.pos_ffn(enc_output)
        enc_output *= non_pad_mask
        return enc_output, enc_slf_attn


class AttentionLayer(nn.Module):
    def __init__(self, d_hidden, d_model, dropout=0.1):
        super().__init__()
        self.attn = MultiplicativeAttention(d_model, d_hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, enc_output, ses_hidden, non_pad_mask=None):
        #- Compute attention distribution
        attn_distr = self.attn(enc_output, ses_hidden, non_pad_mask)
        #- Weight accordingly
        attn_output = self.dropout(attn_distr * enc_output)
        return attn_output, attn_distr


class DecoderLayer(nn.Module):
    def __init__(self, d_model, d_inner, n_head, d_k, d_v, dropout=0.1):
        super(DecoderLayer, self).__init__()
        self.slf_attn = MultiHeadAttention(n_head, d_model, d_k, d_v, dropout=dropout)
        self.enc_attn = MultiHeadAttention(n_head, d_model, d_k, d_v, dropout=dropout)
        self.pos_ffn = PositionwiseFeedForward(d_model, d_inner, dropout=dropout)

    def forward(self, dec_input, enc_output, non_pad_mask=None, slf_attn_mask=None, dec_enc_attn_mask=None):
        dec_output, dec_slf_attn = self.slf_attn(dec_input, dec_input, dec_input, mask=slf_attn_mask)
        dec_output *= non_pad_mask
        dec_output, dec_enc_attn = self.enc_attn(dec_output, enc_output, enc_output, mask=dec_enc_attn_mask)
        dec_output *= non_pad_mask
        dec_output = self.pos_ffn(dec_output)
        dec_output *= non_pad_mask
        return dec_output, dec_slf_attn, dec_enc_attn


class Encoder(nn.Module):
    def __init__(self, n_src_vocab, len_max_seq, d_word_vec, n_layers, n_head, d_k, d_v, d_model, d_inner, dropout=0.1):
        super().__init__()
        n_position = len_max_seq + 1
        self.src_word_emb = nn.Embedding(n_src_vocab, d_word_vec, padding_idx=Constants.PAD)
        self.position_enc = nn.Embedding.from_pretrained(
            get_sinusoid_encoding_table(n_position, d_word_vec, padding_idx=0), freeze=True)
        self.layer_stack = nn.ModuleList([
            EncoderLayer(d_model, d_inner, n_head, d_k, d_v, dropout=dropout) for _ in range(n_layers)])

    def forward(self, src_seq, src_pos, return_attns=False):
        slf_attn_mask = get_attn_key_pad_mask(seq_k=src_seq, seq_q=src_seq)
        non_pad_mask = get_non_pad_mask(src_seq)
        enc_output = self.src_word_emb(src_seq) + self.position_enc(src_pos)
        for enc_layer in self.layer_stack:
            enc_output, enc_slf_attn = enc_layer(enc_output, non_pad_mask=non_pad_mask, slf_attn_mask=slf_attn_mask)
        return enc_output,


class Session(nn.Module):
    def __init__(self, d_model, d_hidden, dropout=0.1):
        super().__init__()
        self.d_hidden = d_hidden
        self.memory = nn.LSTMCell(d_model, d_hidden)
        self.attn = AttentionLayer(d_hidden, d_model, dropout)

    def zero_lstm_state(self, batch_size, device):
        ''' Reset LSTM hidden states between batches '''
        self.h = torch.zeros(batch_size, self.d_hidden).to(device)
        self.c = torch.zeros(batch_size, self.d_hidden).to(device)

    def forward(self, enc_output, src_seq, return_attns=False):
        #- Prepare mask
        non_pad_mask = get_non_pad_mask(src_seq)
        enc_output *= non_pad_mask

        #- Extract features
        features, _ = torch.max(enc_output, dim=1)

        #- Compute attention with global context
        self.h, self.c = self.memory(features, (self.h, self.c))
        if FIXED:
            non_pad_mask = non_pad_mask.repeat(1, 1, enc_output.size(-1)).bool()
            ses_output, ses_attn_distr = self.attn(enc_output, self.h, non_pad_mask)
        else:
            ses_output, ses_attn_distr = self.attn(enc_output, self.h)

        if return_attns:
            return ses_output, ses_attn_distr
        return ses_output,


class Decoder(nn.Module):
    def __init__(self, n_tgt_vocab, len_max_seq, d_word_vec, n_layers, n_head, d_k, d_v, d_model, d_inner, dropout=0.1):
        super().__init__()
        n_position = len_max_seq + 1
        self.tgt_word_emb = nn.Embedding(n_tgt_vocab, d_word_vec, padding_idx=Constants.PAD)
        self.position_enc = nn.Embedding.from_pretrained(
            get_sinusoid_encoding_table(n_position, d_word_vec, padding_idx=0), freeze=True)
        self.layer_stack = nn.ModuleList([
            DecoderLayer(d_model, d_inner, n_head, d_k, d_v, dropout=dropout) for _ in range(n_layers)])

    def forward(self, tgt_seq, tgt_pos, src_seq, enc_output, return_attns=False):
        non_pad_mask = get_non_pad_mask(tgt_seq)
        slf_attn_mask_subseq = get_subsequent_mask(tgt_seq)
        slf_attn_mask_keypad = get_attn_key_pad_mask(seq_k=tgt_seq, seq_q=tgt_seq)
        slf_attn_mask = (slf_attn_mask_keypad + slf_attn_mask_subseq).gt(0)
        dec_enc_attn_mask = get_attn_key_pad_mask(seq_k=src_seq, seq_q=tgt_seq)
        dec_output = self.tgt_word_emb(tgt_seq) + self.position_enc(tgt_pos)
        for dec_layer in self.layer_stack:
            dec_output, dec_slf_attn, dec_enc_attn = dec_layer(
                dec_output, enc_output, non_pad_mask=non_pad_mask,
                slf_attn_mask=slf_attn_mask, dec_enc_attn_mask=dec_enc_attn_mask)
        return dec_output,


class Transformer(nn.Module):
    ''' A sequence to sequence model with attention mechanism. '''

    def __init__(self, n_src_vocab, n_tgt_vocab, len_max_seq, d_word_vec=16, d_model=16, d_inner=32, d_hidden=24,
                 n_layers=2, n_head=2, d_k=8, d_v=8, dropout=0.1, tgt_emb_prj_weight_sharing=True,
                 emb_src_tgt_weight_sharing=True):
        super().__init__()
        self.encoder = Encoder(n_src_vocab=n_src_vocab, len_max_seq=len_max_seq, d_word_vec=d_word_vec,
                               d_model=d_model, d_inner=d_inner, n_layers=n_layers, n_head=n_head, d_k=d_k,
                               d_v=d_v, dropout=dropout)
        self.session = Session(d_model, d_hidden, dropout)
        self.decoder = Decoder(n_tgt_vocab=n_tgt_vocab, len_max_seq=len_max_seq, d_word_vec=d_word_vec,
                               d_model=d_model, d_inner=d_inner, n_layers=n_layers, n_head=n_head, d_k=d_k,
                               d_v=d_v, dropout=dropout)
        self.tgt_word_prj = nn.Linear(d_model, n_tgt_vocab, bias=False)
        nn.init.xavier_normal_(self.tgt_word_prj.weight)
        if tgt_emb_prj_weight_sharing:
            self.tgt_word_prj.weight = self.decoder.tgt_word_emb.weight
            self.x_logit_scale = (d_model ** -0.5)
        else:
            self.x_logit_scale = 1.
        if emb_src_tgt_weight_sharing:
            self.encoder.src_word_emb.weight = self.decoder.tgt_word_emb.weight

    def forward(self, src_seq, src_pos, tgt_seq, tgt_pos):
        tgt_seq, tgt_pos = tgt_seq[:, :-1], tgt_pos[:, :-1]
        enc_output, *_ = self.encoder(src_seq, src_pos)
        ses_output, *_ = self.session(enc_output, src_seq)
        dec_output, *_ = self.decoder(tgt_seq, tgt_pos, src_seq, ses_output)
        seq_logit = self.tgt_word_prj(dec_output) * self.x_logit_scale
        return seq_logit.view(-1, seq_logit.size(2))


def collate_fn(insts):
    ''' Pad the instance to the max seq length in batch '''
    max_len = max(len(inst) for inst in insts)
    batch_seq = np.array([inst + [Constants.PAD] * (max_len - len(inst)) for inst in insts])
    batch_pos = np.array([[pos_i + 1 if w_i != Constants.PAD else 0 for pos_i, w_i in enumerate(inst)]
                          for inst in batch_seq])
    return torch.LongTensor(batch_seq), torch.LongTensor(batch_pos)


if __name__ == "__main__":
    n_vocab = 30
    model = Transformer(n_vocab, n_vocab, len_max_seq=12)
    model.eval()

    src_insts = [[2, 7, 9, 11, 3], [2, 5, 14, 8, 21, 17, 6, 12, 3]]
    tgt_insts = [[2, 10, 13, 3], [2, 19, 4, 22, 16, 3]]
    src_seq, src_pos = collate_fn(src_insts)
    tgt_seq, tgt_pos = collate_fn(tgt_insts)

    with torch.no_grad():
        model.session.zero_lstm_state(src_seq.size(0), src_seq.device)
        pred = model(src_seq, src_pos, tgt_seq, tgt_pos)
        gold = tgt_seq[:, 1:].contiguous().view(-1)
        loss = F.cross_entropy(pred, gold, ignore_index=Constants.PAD, reduction='sum')
    print("loss:", round(loss.item(), 5))
    print("argmax (first reply):", pred.view(2, -1, n_vocab)[0].argmax(-1).tolist())
