"""d2l.ai Transformer: masked_softmax with 1-D valid_lens (encoder, cross) and 2-D valid_lens (decoder).

Follows d2l-ai/d2l-en d2l/torch.py (masked_softmax, DotProductAttention, MultiHeadAttention,
TransformerDecoderBlock). The book masks by *valid length*, not by a boolean matrix:
- encoder self-attention and decoder cross-attention get enc_valid_lens of shape (batch,): each query of
  sample i sees keys [0, valid_len[i]) (the source's right padding is filled with -1e6 before softmax);
- decoder self-attention during training gets dec_valid_lens = arange(1, num_steps + 1).repeat(batch, 1),
  shape (batch, num_steps): query t sees keys [0, t], which is the causal mask written as lengths.
The decoder (6 steps) is longer than the padded source (5 tokens, lengths 5 and 2) on purpose.
"""
import math

import torch
from torch import nn
import torch.nn.functional as F


def masked_softmax(X, valid_lens):
    """Perform softmax operation by masking elements on the last axis."""
    # X: 3D tensor, valid_lens: 1D or 2D tensor
    def _sequence_mask(X, valid_len, value=0):
        maxlen = X.size(1)
        mask = torch.arange((maxlen), dtype=torch.float32,
                            device=X.device)[None, :] < valid_len[:, None]
        X[~mask] = value
        return X

    if valid_lens is None:
        return nn.functional.softmax(X, dim=-1)
    else:
        shape = X.shape
        if valid_lens.dim() == 1:
            valid_lens = torch.repeat_interleave(valid_lens, shape[1])
        else:
            valid_lens = valid_lens.reshape(-1)
        # On the last axis, replace masked elements with a very large negative
        # value, whose exponentiation outputs 0
        X = _sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
        return nn.functional.softmax(X.reshape(shape), dim=-1)


class DotProductAttention(nn.Module):
    """Scaled dot product attention."""
    def __init__(self, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens=None):
        d = queries.shape[-1]
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


class MultiHeadAttention(nn.Module):
    """Multi-head attention."""
    def __init__(self, num_hiddens, num_heads, dropout, bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.attention = DotProductAttention(dropout)
        self.W_q = nn.Linear(num_hiddens, num_hiddens, bias=bias)
        self.W_k = nn.Linear(num_hiddens, num_hiddens, bias=bias)
        self.W_v = nn.Linear(num_hiddens, num_hiddens, bias=bias)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias)

    def forward(self, queries, keys, values, valid_lens):
        queries = self.transpose_qkv(self.W_q(queries))
        keys = self.transpose_qkv(self.W_k(keys))
        values = self.transpose_qkv(self.W_v(values))
        if valid_lens is not None:
            # On axis 0, copy the first item (scalar or vector) for num_heads times
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        output = self.attention(queries, keys, values, valid_lens)
        output_concat = self.transpose_output(output)
        return self.W_o(output_concat)

    def transpose_qkv(self, X):
        X = X.reshape(X.shape[0], X.shape[1], self.num_heads, -1)
        X = X.permute(0, 2, 1, 3)
        return X.reshape(-1, X.shape[2], X.shape[3])

    def transpose_output(self, X):
        X = X.reshape(-1, self.num_heads, X.shape[1], X.shape[2])
        X = X.permute(0, 2, 1, 3)
        return X.reshape(X.shape[0], X.shape[1], -1)


class AddNorm(nn.Module):
    def __init__(self, norm_shape, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.ln = nn.LayerNorm(norm_shape)

    def forward(self, X, Y):
        return self.ln(self.dropout(Y) + X)


class PositionWiseFFN(nn.Module):
    def __init__(self, num_hiddens, ffn_num_hiddens, num_outputs):
        super().__init__()
        self.dense1 = nn.Linear(num_hiddens, ffn_num_hiddens)
        self.relu = nn.ReLU()
        self.dense2 = nn.Linear(ffn_num_hiddens, num_outputs)

    def forward(self, X):
        return self.dense2(self.relu(self.dense1(X)))


class TransformerEncoderBlock(nn.Module):
    def __init__(self, num_hiddens, ffn_num_hiddens, num_heads, dropout):
        super().__init__()
        self.attention = MultiHeadAttention(num_hiddens, num_heads, dropout)
        self.addnorm1 = AddNorm(num_hiddens, dropout)
        self.ffn = PositionWiseFFN(num_hiddens, ffn_num_hiddens, num_hiddens)
        self.addnorm2 = AddNorm(num_hiddens, dropout)

    def forward(self, X, valid_lens):
        Y = self.addnorm1(X, self.attention(X, X, X, valid_lens))
        return self.addnorm2(Y, self.ffn(Y))


class TransformerDecoderBlock(nn.Module):
    # The i-th block in the Transformer decoder
    def __init__(self, num_hiddens, ffn_num_hiddens, num_heads, dropout, i):
        super().__init__()
        self.i = i
        self.attention1 = MultiHeadAttention(num_hiddens, num_heads, dropout)
        self.addnorm1 = AddNorm(num_hiddens, dropout)
        self.attention2 = MultiHeadAttention(num_hiddens, num_heads, dropout)
        self.addnorm2 = AddNorm(num_hiddens, dropout)
        self.ffn = PositionWiseFFN(num_hiddens, ffn_num_hiddens, num_hiddens)
        self.addnorm3 = AddNorm(num_hiddens, dropout)

    def forward(self, X, state):
        enc_outputs, enc_valid_lens = state[0], state[1]
        # During training, all the tokens of any output sequence are processed
        # at the same time, so state[2][self.i] is None as initialized.
        if state[2][self.i] is None:
            key_values = X
        else:
            key_values = torch.cat((state[2][self.i], X), dim=1)
        state[2][self.i] = key_values
        if self.training:
            batch_size, num_steps, _ = X.shape
            # Shape of dec_valid_lens: (batch_size, num_steps), where every
            # row is [1, 2, ..., num_steps]
            dec_valid_lens = torch.arange(1, num_steps + 1, device=X.device).repeat(batch_size, 1)
        else:
            dec_valid_lens = None
        X2 = self.attention1(X, key_values, key_values, dec_valid_lens)
        Y = self.addnorm1(X, X2)
        # Encoder-decoder attention. Shape of enc_outputs: (batch_size, num_steps, num_hiddens)
        Y2 = self.attention2(Y, enc_outputs, enc_outputs, enc_valid_lens)
        Z = self.addnorm2(Y, Y2)
        return self.addnorm3(Z, self.ffn(Z)), state


def _reference(mha, q_in, kv_in, keep):
    """Same projections, then F.scaled_dot_product_attention with an explicit boolean mask."""
    h = mha.num_heads
    B, Lq, D = q_in.shape
    def split(x):
        return x.reshape(B, x.shape[1], h, -1).transpose(1, 2)
    q, k, v = split(mha.W_q(q_in)), split(mha.W_k(kv_in)), split(mha.W_v(kv_in))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])
    return mha.W_o(out.transpose(1, 2).reshape(B, Lq, D))


def main():
    torch.manual_seed(0)
    num_hiddens, ffn_num_hiddens, num_heads, dropout = 16, 32, 4, 0.0
    batch, src_len, num_steps = 2, 5, 6
    enc_valid_lens = torch.tensor([5, 2])

    encoder_blk = TransformerEncoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout)
    decoder_blk = TransformerDecoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout, 0)
    encoder_blk.train()
    decoder_blk.train()

    src = torch.randn(batch, src_len, num_hiddens)
    tgt = torch.randn(batch, num_steps, num_hiddens)
    with torch.no_grad():
        enc_outputs = encoder_blk(src, enc_valid_lens)
        state = [enc_outputs, enc_valid_lens, [None]]
        dec_out, state = decoder_blk(tgt, state)

        key_ok = torch.arange(src_len)[None, :] < enc_valid_lens[:, None]          # (B, Lk)
        enc_keep = key_ok[:, None, :].expand(batch, src_len, src_len)
        ref_enc_attn = _reference(encoder_blk.attention, src, src, enc_keep)
        got_enc_attn = encoder_blk.attention(src, src, src, enc_valid_lens)
        assert torch.allclose(got_enc_attn, ref_enc_attn, atol=1e-5)

        causal = torch.tril(torch.ones(num_steps, num_steps, dtype=torch.bool))
        dec_keep = causal[None].expand(batch, num_steps, num_steps)
        ref_self = _reference(decoder_blk.attention1, tgt, tgt, dec_keep)
        Y = decoder_blk.addnorm1(tgt, ref_self)
        cross_keep = key_ok[:, None, :].expand(batch, num_steps, src_len)
        ref_cross = _reference(decoder_blk.attention2, Y, enc_outputs, cross_keep)
        Z = decoder_blk.addnorm2(Y, ref_cross)
        ref_out = decoder_blk.addnorm3(Z, decoder_blk.ffn(Z))
        assert torch.allclose(dec_out, ref_out, atol=1e-5)
    print("d2l transformer block ok:", tuple(dec_out.shape))


if __name__ == "__main__":
    main()
