# Reproduces pengshuang/Transformer#7: the encoder-decoder (context) attention mask is built as
# padding_mask(tgt_seq, src_seq), i.e. memory keys are masked where the *target* is padded, not the source.
import sys

import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class ScaledDotProductAttention(nn.Module):
    def __init__(self, attention_dropout=0.0):
        super(ScaledDotProductAttention, self).__init__()
        self.dropout = nn.Dropout(attention_dropout)
        self.softmax = nn.Softmax(dim=2)

    def forward(self, q, k, v, scale=None, attn_mask=None):
        attention = torch.bmm(q, k.transpose(1, 2))
        if scale:
            attention = attention * scale
        if attn_mask is not None:
            attention = attention.masked_fill_(attn_mask, -np.inf)
        attention = self.softmax(attention)
        attention = self.dropout(attention)
        context = torch.bmm(attention, v)
        return context, attention


class MultiHeadAttention(nn.Module):
    def __init__(self, model_dim=16, num_heads=2, dropout=0.0):
        super(MultiHeadAttention, self).__init__()
        self.dim_per_head = model_dim // num_heads
        self.num_heads = num_heads
        self.linear_k = nn.Linear(model_dim, model_dim)
        self.linear_v = nn.Linear(model_dim, model_dim)
        self.linear_q = nn.Linear(model_dim, model_dim)
        self.dot_product_attention = ScaledDotProductAttention(dropout)
        self.linear_final = nn.Linear(model_dim, model_dim)
        self.layer_norm = nn.LayerNorm(model_dim)

    def forward(self, key, value, query, attn_mask=None):
        residual = query
        B = key.size(0)
        h, d = self.num_heads, self.dim_per_head

        def split(x):
            return x.view(B, -1, h, d).transpose(1, 2).reshape(B * h, -1, d)

        key, value, query = split(self.linear_k(key)), split(self.linear_v(value)), split(self.linear_q(query))
        if attn_mask is not None:
            attn_mask = attn_mask.repeat_interleave(h, dim=0)
        scale = key.size(-1) ** -0.5
        context, attention = self.dot_product_attention(query, key, value, scale, attn_mask)
        context = context.view(B, h, -1, d).transpose(1, 2).reshape(B, -1, h * d)
        output = self.linear_final(context)
        return self.layer_norm(residual + output), attention


def padding_mask(seq_k, seq_q):
    # seq_k, seq_q: [B, L]; `PAD` is 0
    len_q = seq_q.size(1)
    pad_mask = seq_k.eq(0)
    return pad_mask.unsqueeze(1).expand(-1, len_q, -1)  # [B, L_q, L_k]


def sequence_mask(seq):
    batch_size, seq_len = seq.size()
    mask = torch.triu(torch.ones((seq_len, seq_len), dtype=torch.uint8), diagonal=1)
    return mask.unsqueeze(0).expand(batch_size, -1, -1)


class Transformer(nn.Module):
    def __init__(self, src_vocab_size=20, tgt_vocab_size=20, model_dim=16, num_heads=2):
        super(Transformer, self).__init__()
        self.src_emb = nn.Embedding(src_vocab_size + 1, model_dim, padding_idx=0)
        self.tgt_emb = nn.Embedding(tgt_vocab_size + 1, model_dim, padding_idx=0)
        self.enc_attn = MultiHeadAttention(model_dim, num_heads)
        self.dec_self_attn = MultiHeadAttention(model_dim, num_heads)
        self.dec_ctx_attn = MultiHeadAttention(model_dim, num_heads)
        self.linear = nn.Linear(model_dim, tgt_vocab_size, bias=False)

    def forward(self, src_seq, tgt_seq):
        x = self.src_emb(src_seq)
        output, _ = self.enc_attn(x, x, x, padding_mask(src_seq, src_seq))
        if FIXED:
            context_attn_mask = padding_mask(src_seq, tgt_seq)
        else:
            context_attn_mask = padding_mask(tgt_seq, src_seq)
        y = self.tgt_emb(tgt_seq)
        self_attn_mask = torch.gt(padding_mask(tgt_seq, tgt_seq).to(torch.uint8) + sequence_mask(tgt_seq), 0)
        y, _ = self.dec_self_attn(y, y, y, self_attn_mask)
        y, ctx_attn = self.dec_ctx_attn(output, output, y, context_attn_mask)
        return self.linear(y), ctx_attn


def main():
    torch.manual_seed(0)
    model = Transformer().eval()
    # batch of two pairs, both padded to length 6 (PAD = 0); the padding of source and target differs
    src_seq = torch.tensor([[3, 5, 7, 9, 11, 0], [4, 6, 8, 10, 12, 14]])
    tgt_seq = torch.tensor([[1, 2, 0, 0, 0, 0], [1, 2, 3, 4, 5, 0]])
    with torch.no_grad():
        logits, ctx_attn = model(src_seq, tgt_seq)
    # attention mass the first decoder position puts on real source tokens vs source padding (pair 0)
    w = ctx_attn[0, 0]
    print(f"{'fixed' if FIXED else 'buggy'}: ctx attn of tgt[0,0] on real src pos 2-4 = {w[2:5].sum():.3f}, on src PAD = {w[5]:.3f}")
    print(f"logit[0,0,:3] = {logits[0, 0, :3].tolist()}")


if __name__ == "__main__":
    main()
