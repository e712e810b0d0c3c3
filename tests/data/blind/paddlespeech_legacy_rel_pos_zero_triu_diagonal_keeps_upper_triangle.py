"""PaddleSpeech (ESPnet port): zero_triu keeps the whole relative-position matrix.

Citation: PaddlePaddle/PaddleSpeech#2770 ("[TTS]Fix attention bugs and sort VITS data with
feats_lengths", commit 2e51e0da). Read from the upstream git history:
paddlespeech/t2s/modules/transformer/attention.py, embedding.py, conformer/encoder_layer.py
and models/ernie_sat/ernie_sat.py at 2e51e0da^, and the diff of 2e51e0da.

Bug: ``LegacyRelPositionMultiHeadedAttention.rel_shift`` (ported from ESPnet, used by ERNIE-SAT's
``legacy_rel_selfattn`` encoder) is meant, with ``zero_triu=True``, "to zero the upper
triangular part of attention matrix" after the Transformer-XL shift. The port wrote
``x * paddle.tril(ones((t1, t2)), t2 - 1)``: for self-attention t1 == t2, so the diagonal offset
t2 - 1 keeps every entry and nothing is zeroed; the positional term of each query still scores
the keys after it (whose shifted entries are the wrapped-around garbage of the shift trick).

Fix: ``paddle.tril(ones, t2 - t1)`` (ESPnet's ``x.size(3) - x.size(2)``), i.e. the main
diagonal for self-attention.

This program: a trimmed ERNIE-SAT MLMEncoder in torch (speech frames and phone ids embedded,
each with a LegacyRelPositionalEncoding, concatenated with their non-pad masks, then Conformer-
style EncoderLayers with legacy relative-position self-attention, zero_triu=True), on a batch
of two right-padded utterances. Paddle calls are written with their torch equivalents.
"""
import math
import sys

import numpy
import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def masked_fill(xs, mask, value):
    bshape = torch.broadcast_shapes(xs.shape, mask.shape)
    mask = mask.broadcast_to(bshape)
    trues = torch.ones_like(xs) * value
    mask = mask.to(torch.bool)
    xs = torch.where(mask, trues, xs)
    return xs


def make_non_pad_mask(lengths, max_len):
    seq_range = torch.arange(0, max_len, dtype=torch.int64)
    return seq_range.unsqueeze(0) < lengths.unsqueeze(-1)


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        assert n_feat % n_head == 0
        # We assume d_v always equals d_k
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query, key, value):
        n_batch = query.shape[0]
        q = self.linear_q(query).reshape([n_batch, -1, self.h, self.d_k])
        k = self.linear_k(key).reshape([n_batch, -1, self.h, self.d_k])
        v = self.linear_v(value).reshape([n_batch, -1, self.h, self.d_k])
        q = q.permute(0, 2, 1, 3)  # (batch, head, time1, d_k)
        k = k.permute(0, 2, 1, 3)  # (batch, head, time2, d_k)
        v = v.permute(0, 2, 1, 3)  # (batch, head, time2, d_k)
        return q, k, v

    def forward_attention(self, value, scores, mask=None):
        n_batch = value.shape[0]
        softmax = nn.Softmax(dim=-1)
        if mask is not None:
            mask = mask.unsqueeze(1)
            mask = torch.logical_not(mask)
            # assume scores.dtype==float32, we only use "float32" here
            min_value = numpy.finfo("float32").min
            scores = masked_fill(scores, mask, min_value)
            self.attn = softmax(scores)
            self.attn = masked_fill(self.attn, mask, 0.0)
        else:
            self.attn = softmax(scores)
        p_attn = self.dropout(self.attn)
        x = torch.matmul(p_attn, value)
        x = x.permute(0, 2, 1, 3).reshape(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)


class LegacyRelPositionMultiHeadedAttention(MultiHeadedAttention):
    """Multi-Head Attention layer with relative position encoding (old version)."""

    def __init__(self, n_head, n_feat, dropout_rate, zero_triu=False):
        super().__init__(n_head, n_feat, dropout_rate)
        self.zero_triu = zero_triu
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(self.h, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    def rel_shift(self, x):
        b, h, t1, t2 = x.shape
        zero_pad = torch.zeros((b, h, t1, 1))
        x_padded = torch.cat([zero_pad, x], dim=-1)
        x_padded = x_padded.reshape([b, h, t2 + 1, t1])
        # only keep the positions from 0 to time2
        x = x_padded[:, :, 1:].reshape([b, h, t1, t2])

        if self.zero_triu:
            ones = torch.ones((t1, t2))
            if FIXED:
                x = x * torch.tril(ones, t2 - t1)[None, None, :, :]
            else:
                x = x * torch.tril(ones, t2 - 1)[None, None, :, :]

        return x

    def forward(self, query, key, value, pos_emb, mask):
        q, k, v = self.forward_qkv(query, key, value)
        q = q.permute(0, 2, 1, 3)  # (batch, time1, head, d_k)

        n_batch_pos = pos_emb.shape[0]
        p = self.linear_pos(pos_emb).reshape([n_batch_pos, -1, self.h, self.d_k])
        p = p.permute(0, 2, 1, 3)  # (batch, head, time1, d_k)
        q_with_bias_u = (q + self.pos_bias_u).permute(0, 2, 1, 3)
        q_with_bias_v = (q + self.pos_bias_v).permute(0, 2, 1, 3)

        # matrix a and c, (batch, head, time1, time2)
        matrix_ac = torch.matmul(q_with_bias_u, k.transpose(-1, -2))
        # matrix b and d, (batch, head, time1, time1)
        matrix_bd = torch.matmul(q_with_bias_v, p.transpose(-1, -2))
        matrix_bd = self.rel_shift(matrix_bd)
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)

        return self.forward_attention(v, scores, mask)


class LegacyRelPositionalEncoding(nn.Module):
    """Relative positional encoding module (old version), reverse positions."""

    def __init__(self, d_model, dropout_rate, max_len=5000):
        super().__init__()
        self.d_model = d_model
        self.reverse = True
        self.xscale = math.sqrt(self.d_model)
        self.dropout = nn.Dropout(p=dropout_rate)
        self.pe = None
        self.extend_pe(torch.zeros(1, max_len))

    def extend_pe(self, x):
        if self.pe is not None and self.pe.shape[1] >= x.shape[1]:
            return
        pe = torch.zeros((x.shape[1], self.d_model))
        position = torch.arange(x.shape[1] - 1, -1, -1.0).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, self.d_model, 2).float() * -(math.log(10000.0) / self.d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.pe = pe.unsqueeze(0)

    def forward(self, x):
        self.extend_pe(x)
        x = x * self.xscale
        pos_emb = self.pe[:, :x.shape[1]]
        return self.dropout(x), self.dropout(pos_emb)


class EncoderLayer(nn.Module):
    """Conformer EncoderLayer, without macaron FFN / conv module / stochastic depth."""

    def __init__(self, size, self_attn, feed_forward, dropout_rate, normalize_before=True):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.ff_scale = 1.0
        self.norm_ff = nn.LayerNorm(size)
        self.norm_mha = nn.LayerNorm(size)
        self.dropout = nn.Dropout(dropout_rate)
        self.size = size
        self.normalize_before = normalize_before

    def forward(self, x_input, mask):
        x, pos_emb = x_input
        residual = x
        if self.normalize_before:
            x = self.norm_mha(x)
        x_att = self.self_attn(x, x, x, pos_emb, mask)
        x = residual + self.dropout(x_att)
        if not self.normalize_before:
            x = self.norm_mha(x)

        residual = x
        if self.normalize_before:
            x = self.norm_ff(x)
        x = residual + self.ff_scale * self.dropout(self.feed_forward(x))
        if not self.normalize_before:
            x = self.norm_ff(x)
        return (x, pos_emb), mask


class MLMEncoder(nn.Module):
    def __init__(self, idim, vocab_size, attention_dim=32, attention_heads=4, linear_units=64,
                 num_blocks=2, dropout_rate=0.0, positional_dropout_rate=0.0,
                 attention_dropout_rate=0.0, zero_triu=False):
        super().__init__()
        self.speech_embed = nn.Sequential(
            nn.Linear(idim, attention_dim),
            LegacyRelPositionalEncoding(attention_dim, positional_dropout_rate))
        self.text_embed = nn.Sequential(
            nn.Embedding(vocab_size, attention_dim, padding_idx=0),
            LegacyRelPositionalEncoding(attention_dim, positional_dropout_rate))
        encoder_selfattn_layer_args = (attention_heads, attention_dim, attention_dropout_rate, zero_triu)
        self.encoders = nn.ModuleList([
            EncoderLayer(
                attention_dim,
                LegacyRelPositionMultiHeadedAttention(*encoder_selfattn_layer_args),
                nn.Sequential(nn.Linear(attention_dim, linear_units), nn.ReLU(),
                              nn.Linear(linear_units, attention_dim)),
                dropout_rate)
            for _ in range(num_blocks)])
        self.after_norm = nn.LayerNorm(attention_dim)

    def forward(self, speech, text, speech_mask, text_mask):
        speech = self.speech_embed(speech)
        text = self.text_embed(text)
        xs = torch.cat([speech[0], text[0]], dim=1)
        xs_pos_emb = torch.cat([speech[1], text[1]], dim=1)
        masks = torch.cat([speech_mask, text_mask], dim=-1)

        x_input = (xs, xs_pos_emb)
        for layer in self.encoders:
            x_input, masks = layer(x_input, masks)
        xs = self.after_norm(x_input[0])
        return xs, masks


def main():
    torch.manual_seed(0)
    odim, vocab = 8, 20
    model = MLMEncoder(idim=odim, vocab_size=vocab, zero_triu=True).eval()

    speech_lengths = torch.tensor([6, 4])
    text_lengths = torch.tensor([4, 3])
    speech = torch.randn(2, 6, odim)
    text = torch.randint(1, vocab, (2, 4))
    for i in range(2):
        speech[i, speech_lengths[i]:] = 0.0
        text[i, text_lengths[i]:] = 0
    speech_mask = make_non_pad_mask(speech_lengths, 6).unsqueeze(1)  # (B, 1, T_speech)
    text_mask = make_non_pad_mask(text_lengths, 4).unsqueeze(1)  # (B, 1, T_text)

    with torch.no_grad():
        xs, masks = model(speech, text, speech_mask, text_mask)
    print("encoder output", tuple(xs.shape))
    print("utt 0, first speech frame:", [round(v, 4) for v in xs[0, 0, :4].tolist()])
    print("utt 1, first speech frame:", [round(v, 4) for v in xs[1, 0, :4].tolist()])


if __name__ == "__main__":
    main()
