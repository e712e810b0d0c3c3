# keitakurita/Practical_NLP_in_PyTorch, deep_dives/transformer_from_scratch.ipynb, PR #8 "mask missing in
# ScaledDotProductAttention call": AttentionHead.forward takes mask= but calls self.attn(Q, K, V) without it.
import sys
import math
from enum import IntEnum
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Dim(IntEnum):
    batch = 0
    seq = 1
    feature = 2


class ScaledDotProductAttention(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        d_k = k.size(-1)
        assert q.size(-1) == d_k
        attn = torch.bmm(q, k.transpose(Dim.seq, Dim.feature))  # (Batch, Seq, Seq)
        attn = attn / math.sqrt(d_k)
        attn = torch.exp(attn)
        # fill attention weights with 0s where padded
        if mask is not None:
            attn = attn.masked_fill(mask, 0)
        attn = attn / attn.sum(dim=-1, keepdim=True)
        attn = self.dropout(attn)
        return torch.bmm(attn, v)  # (Batch, Seq, Feature)


class AttentionHead(nn.Module):
    def __init__(self, d_model, d_feature, dropout=0.1):
        super().__init__()
        self.attn = ScaledDotProductAttention(dropout)
        self.query_tfm = nn.Linear(d_model, d_feature)
        self.key_tfm = nn.Linear(d_model, d_feature)
        self.value_tfm = nn.Linear(d_model, d_feature)

    def forward(self, queries, keys, values, mask=None):
        Q = self.query_tfm(queries)  # (Batch, Seq, Feature)
        K = self.key_tfm(keys)
        V = self.value_tfm(values)
        # compute multiple attention weighted sums
        if FIXED:
            x = self.attn(Q, K, V, mask=mask)
        else:
            x = self.attn(Q, K, V)
        return x


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, d_feature, n_heads, dropout=0.1):
        super().__init__()
        assert d_model == d_feature * n_heads
        self.attn_heads = nn.ModuleList([AttentionHead(d_model, d_feature, dropout) for _ in range(n_heads)])
        self.projection = nn.Linear(d_feature * n_heads, d_model)

    def forward(self, queries, keys, values, mask=None):
        x = [attn(queries, keys, values, mask=mask) for i, attn in enumerate(self.attn_heads)]
        x = torch.cat(x, dim=Dim.feature)  # (Batch, Seq, D_Feature * n_heads)
        return self.projection(x)  # (Batch, Seq, D_Model)


class LayerNorm(nn.Module):
    def __init__(self, d_model, eps=1e-8):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(d_model))
        self.beta = nn.Parameter(torch.zeros(d_model))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.gamma * (x - mean) / (std + self.eps) + self.beta


class EncoderBlock(nn.Module):
    def __init__(self, d_model=32, d_feature=8, d_ff=64, n_heads=4, dropout=0.1):
        super().__init__()
        self.attn_head = MultiHeadAttention(d_model, d_feature, n_heads, dropout)
        self.layer_norm1 = LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.position_wise_feed_forward = nn.Sequential(
            nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model))
        self.layer_norm2 = LayerNorm(d_model)

    def forward(self, x, mask=None):
        att = self.attn_head(x, x, x, mask=mask)
        x = x + self.dropout(self.layer_norm1(att))
        pos = self.position_wise_feed_forward(x)
        x = x + self.dropout(self.layer_norm2(pos))
        return x


class TransformerEncoder(nn.Module):
    def __init__(self, n_blocks=2, d_model=32, n_heads=4, d_ff=64, dropout=0.1):
        super().__init__()
        self.encoders = nn.ModuleList([
            EncoderBlock(d_model=d_model, d_feature=d_model // n_heads, d_ff=d_ff, dropout=dropout)
            for _ in range(n_blocks)])

    def forward(self, x, mask=None):
        for encoder in self.encoders:
            x = encoder(x, mask=mask)
        return x


class PositionalEmbedding(nn.Module):
    def __init__(self, d_model, max_len=64):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len).unsqueeze(1).float()
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("weight", pe)

    def forward(self, x):
        return self.weight[:x.size(1), :].unsqueeze(0)


PAD = 0
vocab_size, d_model = 20, 32
emb = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
pos_emb = PositionalEmbedding(d_model)
encoder = TransformerEncoder(d_model=d_model)
encoder.eval()

tokens = torch.tensor([[5, 7, 3, 9, 11, 2],
                       [4, 8, 6, PAD, PAD, PAD]])
lengths = (tokens != PAD).sum(1)


def encode(tokens):
    # mask: True where the key is padding, (Batch, Seq_q, Seq_k)
    pad = (tokens == PAD)
    mask = pad.unsqueeze(1).expand(tokens.size(0), tokens.size(1), tokens.size(1))
    return encoder(emb(tokens) + pos_emb(tokens), mask=mask)


with torch.no_grad():
    batched = encode(tokens)
    worst = 0.0
    for b in range(tokens.size(0)):
        n = int(lengths[b])
        alone = encode(tokens[b:b + 1, :n])
        worst = max(worst, (batched[b, :n] - alone[0]).abs().max().item())
print("max |padded batch - unpadded sequence| over real tokens: %.5f" % worst)
