# Citation: hirofumi0810/neural_sp commit e993b35b6e04e094157b2b8940da7583428158da
#   ("Fix mask for transformer", 2019-05-29).
# Upstream files: neural_sp/models/seq2seq/decoders/transformer.py (TransformerDecoder.forward_att),
#   neural_sp/models/modules/transformer.py (TransformerDecoderBlock / TransformerEncoderBlock),
#   neural_sp/models/modules/multihead_attention.py (MultiheadAttentionMechanism.forward),
#   neural_sp/models/torch_utils.py (pad_list, make_pad_mask).
# Bug: the attention decoder of the ASR model (CTC + attention) took the key lengths of its
#   self-attention from the label lengths BEFORE <sos> was prepended (ylens = [len(y) for y in ys]),
#   while the decoder input ys_in is one token longer; MultiheadAttentionMechanism turned ylens into
#   a key padding mask, so the last real input token of every hypothesis was hidden as a key.
# Fix: ylens = [y.size(0) for y in ys_in] (lengths after <sos>); the same commit builds the mask
#   with make_pad_mask over keys and queries (query rows of padding are masked too, fill -1e9).
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import math

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- torch_utils
def np2tensor(array, device_id=-1):
    return torch.from_numpy(array)


def pad_list(xs, pad_value=0.0, pad_left=False):
    bs = len(xs)
    max_time = max(x.size(0) for x in xs)
    xs_pad = xs[0].new_zeros(bs, max_time, *xs[0].size()[1:]).fill_(pad_value)
    for b in range(bs):
        if len(xs[b]) == 0:
            continue
        if pad_left:
            xs_pad[b, -xs[b].size(0):] = xs[b]
        else:
            xs_pad[b, :xs[b].size(0)] = xs[b]
    return xs_pad


def make_pad_mask(seq_lens, device_id=-1):
    bs = len(seq_lens)
    max_time = max(seq_lens)
    seq_range = torch.arange(0, max_time, dtype=torch.int64)
    seq_range_expand = seq_range.unsqueeze(0).expand(bs, max_time)
    seq_length_expand = seq_range_expand.new(seq_lens).unsqueeze(-1)
    mask = seq_range_expand < seq_length_expand
    return mask


def compute_accuracy(logits, ys_ref, pad):
    pad_pred = logits.view(ys_ref.size(0), ys_ref.size(1), logits.size(-1)).argmax(2)
    mask = ys_ref != pad
    numerator = torch.sum(pad_pred.masked_select(mask) == ys_ref.masked_select(mask))
    denominator = torch.sum(mask)
    acc = float(numerator) * 100 / float(denominator)
    return acc


# ---------------------------------------------------------------- modules
class LinearND(nn.Module):
    def __init__(self, in_size, out_size, bias=True, dropout=0):
        super(LinearND, self).__init__()
        self.fc = nn.Linear(in_size, out_size, bias=bias)
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, xs):
        size = list(xs.size())
        xs = xs.contiguous().view((int(np.prod(size[:-1])), int(size[-1])))
        xs = self.dropout(self.fc(xs))
        size[-1] = xs.size()[-1]
        return xs.view(size)


class MultiheadAttentionMechanism(nn.Module):
    def __init__(self, key_dim, query_dim, attn_type, attn_dim, dropout=0, n_heads=8):
        super(MultiheadAttentionMechanism, self).__init__()
        self.attn_type = attn_type
        assert attn_dim % n_heads == 0
        self.d_k = attn_dim // n_heads
        self.n_heads = n_heads
        self.key = None
        self.value = None
        self.mask = None
        self.attn_dropout = nn.Dropout(p=dropout)
        self.w_key = LinearND(key_dim, attn_dim, bias=False)
        self.w_value = LinearND(key_dim, attn_dim, bias=False)
        self.w_query = LinearND(query_dim, attn_dim, bias=False)
        self.w_out = LinearND(attn_dim, key_dim)

    def forward(self, key, klens, value, query, qlens=None, aw=None, diagonal=False):
        bs, klen = key.size()[:2]
        qlen = query.size(1)

        # Mask attention distribution
        if not FIXED:
            self.mask = key.new_ones(bs, self.n_heads, klen).byte()
            for b in range(bs):
                if klens[b] < klen:
                    self.mask[b, :, klens[b]:] = 0
            self.mask = self.mask.unsqueeze(2)
        else:
            mask = make_pad_mask(klens).unsqueeze(1).expand(bs, qlen, klen)  # `[B, qlen, klen]`
            if qlens is not None:
                query_mask = make_pad_mask(qlens).unsqueeze(2).expand(bs, qlen, klen)
            elif klen == qlen:
                query_mask = make_pad_mask(klens).unsqueeze(2).expand(bs, qlen, klen)
            self.mask = (mask * query_mask).unsqueeze(1)  # `[B, 1, qlen, klen]`

        # Hide future information for self-attention in the Transformer decoder
        if diagonal:
            assert qlen == klen
            subsequent_mask = torch.tril(key.new_ones((qlen, klen)).byte(), diagonal=0)
            subsequent_mask = subsequent_mask.unsqueeze(0).unsqueeze(1).expand(
                bs, self.n_heads, qlen, klen)  # `[B, n_heads, qlen, klen]`
            self.mask = self.mask.byte() & subsequent_mask

        key = self.w_key(key).view(bs, -1, self.n_heads, self.d_k)
        value = self.w_value(value).view(bs, -1, self.n_heads, self.d_k)
        self.key = key.transpose(2, 1).contiguous()      # `[B, n_heads, klen, d_k]`
        self.value = value.transpose(2, 1).contiguous()  # `[B, n_heads, klen, d_k]`
        query = self.w_query(query).view(bs, -1, self.n_heads, self.d_k)
        query = query.transpose(2, 1).contiguous()  # `[B, n_heads, qlen, d_k]`

        e = torch.matmul(query, self.key.transpose(3, 2)) * (self.d_k ** -0.5)

        # Compute attention weights
        e = e.masked_fill_(self.mask == 0, -1e9 if FIXED else -1024)
        aw = F.softmax(e, dim=-1)
        aw = self.attn_dropout(aw)
        cv = torch.matmul(aw, self.value)  # `[B, n_heads, qlen, d_k]`
        cv = cv.transpose(2, 1).contiguous().view(bs, -1, self.n_heads * self.d_k)
        cv = self.w_out(cv)
        return cv, aw


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout, pe_type, max_len=5000):
        super(PositionalEncoding, self).__init__()
        self.pe_type = pe_type
        pe = torch.zeros(max_len, d_model, dtype=torch.float32)
        position = torch.arange(0, max_len, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer('pe', pe.unsqueeze(0))
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, xs):
        xs = xs + self.pe[:, :xs.size(1)]
        return self.dropout(xs)


class SublayerConnection(nn.Module):
    def __init__(self, d_model, dropout, layer_norm_eps=1e-6):
        super(SublayerConnection, self).__init__()
        self.norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, xs, sublayer):
        xs_norm = self.norm(xs)
        output = sublayer(xs_norm)
        if isinstance(output, tuple):
            xs_norm, aws = output
        else:
            xs_norm = output
        xs_norm = self.dropout(xs_norm) + xs
        if isinstance(output, tuple):
            return xs_norm, aws
        return xs_norm


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout):
        super(PositionwiseFeedForward, self).__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, xs):
        return self.w_2(self.dropout(F.relu(self.w_1(xs))))


class TransformerEncoderBlock(nn.Module):
    def __init__(self, d_model, d_ff, attn_type, attn_n_heads, dropout, dropout_att, layer_norm_eps):
        super(TransformerEncoderBlock, self).__init__()
        self.self_attn = MultiheadAttentionMechanism(key_dim=d_model, query_dim=d_model, attn_type=attn_type,
                                                     attn_dim=d_model, n_heads=attn_n_heads, dropout=dropout_att)
        self.add_norm_self_attn = SublayerConnection(d_model, dropout, layer_norm_eps)
        self.ff = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.add_norm_ff = SublayerConnection(d_model, dropout, layer_norm_eps)

    def forward(self, xs, xlens):
        xs, xx_aws = self.add_norm_self_attn(xs, sublayer=lambda xs: self.self_attn(
            key=xs, klens=xlens, value=xs, query=xs))
        xs = self.add_norm_ff(xs, sublayer=lambda xs: self.ff(xs))
        return xs, xx_aws


class TransformerDecoderBlock(nn.Module):
    def __init__(self, d_model, d_ff, attn_type, attn_n_heads, dropout, dropout_att, layer_norm_eps,
                 src_attention=True):
        super(TransformerDecoderBlock, self).__init__()
        self.attn_type = attn_type
        self.src_attention = src_attention
        self.self_attn = MultiheadAttentionMechanism(key_dim=d_model, query_dim=d_model, attn_type=attn_type,
                                                     attn_dim=d_model, n_heads=attn_n_heads, dropout=dropout_att)
        self.add_norm_self_attn = SublayerConnection(d_model, dropout, layer_norm_eps)
        if src_attention:
            self.src_attn = MultiheadAttentionMechanism(key_dim=d_model, query_dim=d_model, attn_type=attn_type,
                                                        attn_dim=d_model, n_heads=attn_n_heads, dropout=dropout_att)
            self.add_norm_src_attn = SublayerConnection(d_model, dropout, layer_norm_eps)
        self.ff = PositionwiseFeedForward(d_model, d_ff, dropout)
        self.add_norm_ff = SublayerConnection(d_model, dropout, layer_norm_eps)

    def forward(self, ys, ylens, xs=None, xlens=None):
        ys, yy_aw = self.add_norm_self_attn(ys, lambda ys: self.self_attn(
            key=ys, klens=ylens, value=ys, query=ys, diagonal=True))
        if self.src_attention:
            if FIXED:
                ys, xy_aw = self.add_norm_src_attn(ys, lambda ys: self.src_attn(
                    key=xs, klens=xlens, value=xs, query=ys, qlens=ylens))
            else:
                ys, xy_aw = self.add_norm_src_attn(ys, lambda ys: self.src_attn(
                    key=xs, klens=xlens, value=xs, query=ys))
        else:
            xy_aw = None
        ys = self.add_norm_ff(ys, lambda ys: self.ff(ys))
        return ys, yy_aw, xy_aw


# ---------------------------------------------------------------- encoder (stand-in front end)
class TransformerEncoder(nn.Module):
    """Tiny version of neural_sp's TransformerEncoder: input projection, positional encoding, blocks."""

    def __init__(self, input_dim, d_model, d_ff, n_heads, n_layers):
        super(TransformerEncoder, self).__init__()
        self.d_model = d_model
        self.embed_in = LinearND(input_dim, d_model)
        self.pos_enc = PositionalEncoding(d_model, 0.0, 'add')
        self.layers = nn.ModuleList([TransformerEncoderBlock(d_model, d_ff, 'scaled_dot', n_heads, 0.0, 0.0, 1e-6)
                                     for _ in range(n_layers)])
        self.norm_top = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, xs, xlens):
        xs = self.embed_in(xs) * (self.d_model ** 0.5)
        xs = self.pos_enc(xs)
        for layer in self.layers:
            xs, _ = layer(xs, xlens)
        return self.norm_top(xs), xlens


# ---------------------------------------------------------------- decoder
class TransformerDecoder(nn.Module):
    def __init__(self, eos, unk, pad, blank, enc_n_units, attn_type, attn_n_heads, n_layers, d_model, d_ff,
                 vocab, pe_type='add', layer_norm_eps=1e-6, dropout=0.0, dropout_emb=0.0, dropout_att=0.0,
                 backward=False):
        super(TransformerDecoder, self).__init__()
        self.eos = eos
        self.unk = unk
        self.pad = pad
        self.blank = blank
        self.d_model = d_model
        self.n_layers = n_layers
        self.backward = backward
        self.device_id = -1
        self.adaptive_softmax = None
        self.lsm_prob = 0.0
        self.embed = nn.Embedding(vocab, d_model, padding_idx=pad)
        self.pos_enc = PositionalEncoding(d_model, dropout_emb, pe_type)
        self.layers = nn.ModuleList([TransformerDecoderBlock(d_model, d_ff, attn_type, attn_n_heads, dropout,
                                                             dropout_att, layer_norm_eps)
                                     for _ in range(n_layers)])
        self.norm_top = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.output = LinearND(d_model, vocab)

    def forward_att(self, eouts, elens, ys, return_logits=False):
        bs = eouts.size(0)

        # Append <sos> and <eos>
        eos = eouts.new_zeros((1,)).fill_(self.eos).long()
        if not FIXED:
            ylens = [len(y) for y in ys]
        ys = [np2tensor(np.fromiter(y[::-1] if self.backward else y, dtype=np.int64), self.device_id).long()
              for y in ys]
        ys_in = [torch.cat([eos, y], dim=0) for y in ys]
        ys_out = [torch.cat([y, eos], dim=0) for y in ys]
        ys_in_pad = pad_list(ys_in, self.pad)
        ys_out_pad = pad_list(ys_out, self.pad)
        if FIXED:
            ylens = [y.size(0) for y in ys_in]

        ys_emb = self.embed(ys_in_pad) * (self.d_model ** 0.5)
        ys_emb = self.pos_enc(ys_emb)
        for l in range(self.n_layers):
            ys_emb, yy_aws, xy_aws = self.layers[l](ys_emb, ylens, eouts, elens)
        logits = self.norm_top(ys_emb)
        logits = self.output(logits)
        if return_logits:
            return logits

        # Compute XE sequence loss
        loss = F.cross_entropy(logits.view((-1, logits.size(2))), ys_out_pad.view(-1),
                               ignore_index=self.pad, reduction='sum') / bs
        acc = compute_accuracy(logits, ys_out_pad, pad=self.pad)
        ppl = min(np.exp(loss.item()), np.inf)
        return loss, acc, ppl


def main():
    torch.manual_seed(0)
    blank, unk, eos, pad = 0, 1, 2, 3
    vocab = 16
    d_model, d_ff, n_heads = 32, 64, 4

    encoder = TransformerEncoder(input_dim=20, d_model=d_model, d_ff=d_ff, n_heads=n_heads, n_layers=2)
    decoder = TransformerDecoder(eos=eos, unk=unk, pad=pad, blank=blank, enc_n_units=d_model,
                                 attn_type='scaled_dot', attn_n_heads=n_heads, n_layers=2,
                                 d_model=d_model, d_ff=d_ff, vocab=vocab)
    encoder.eval()
    decoder.eval()

    # a padded batch of 3 utterances (fbank-like features) and their token transcripts
    xlens = [30, 22, 17]
    xs = torch.randn(len(xlens), max(xlens), 20)
    for b, t in enumerate(xlens):
        xs[b, t:] = 0.0
    g = torch.Generator().manual_seed(1)
    ys = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (7, 5, 3)]

    with torch.no_grad():
        eouts, elens = encoder(xs, xlens)
        loss, acc, ppl = decoder.forward_att(eouts, elens, ys)
        logits = decoder.forward_att(eouts, elens, ys, return_logits=True)

    print("fixed" if FIXED else "buggy")
    print("att loss: %.6f  acc: %.2f  ppl: %.4f" % (loss.item(), acc, ppl))
    for b, y in enumerate(ys):
        last = len(y)  # position that predicts <eos>
        lp = F.log_softmax(logits[b, last], dim=-1)
        print("utt %d: log p(<eos>) at step %d = %.6f" % (b, last, lp[eos].item()))


if __name__ == "__main__":
    main()
