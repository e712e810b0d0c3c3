"""BERT4Rec (jaywonchung/BERT4Rec-VAE-Pytorch) sequential recommender: bidirectional encoder, padded histories.

Follows models/bert_modules/bert.py (BERT.forward) and models/bert_modules/attention/single.py
(Attention.forward: scores.masked_fill(mask == 0, -1e9)). Item histories are truncated to the
last max_len items and LEFT-padded with item id 0 (datasets BertTrainDataset: `padding_len = max_len
- len(tokens); tokens = [0] * padding_len + tokens`). The mask is
`(x > 0).unsqueeze(1).repeat(1, x.size(1), 1).unsqueeze(1)`: every position, padding rows included,
attends to every real item on both sides (no causal triangle: the cloze task predicts masked
items from left AND right context). Padding rows produce outputs nobody reads.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def forward(self, query, key, value, mask=None, dropout=None):
        scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(query.size(-1))
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        p_attn = F.softmax(scores, dim=-1)
        if dropout is not None:
            p_attn = dropout(p_attn)
        return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        assert d_model % h == 0
        self.d_k = d_model // h
        self.h = h
        self.linear_layers = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(3)])
        self.output_linear = nn.Linear(d_model, d_model)
        self.attention = Attention()
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        batch_size = query.size(0)
        query, key, value = [l(x).view(batch_size, -1, self.h, self.d_k).transpose(1, 2)
                             for l, x in zip(self.linear_layers, (query, key, value))]
        x, attn = self.attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(batch_size, -1, self.h * self.d_k)
        return self.output_linear(x)


class TransformerBlock(nn.Module):
    def __init__(self, hidden, attn_heads, feed_forward_hidden, dropout):
        super().__init__()
        self.attention = MultiHeadedAttention(h=attn_heads, d_model=hidden, dropout=dropout)
        self.ff = nn.Sequential(nn.Linear(hidden, feed_forward_hidden), nn.GELU(), nn.Linear(feed_forward_hidden, hidden))
        self.ln1 = nn.LayerNorm(hidden)
        self.ln2 = nn.LayerNorm(hidden)

    def forward(self, x, mask):
        x = x + self.attention(self.ln1(x), self.ln1(x), self.ln1(x), mask=mask)
        return x + self.ff(self.ln2(x))


class BERT(nn.Module):
    def __init__(self, args):
        super().__init__()
        vocab_size = args["num_items"] + 2  # 0 = padding, num_items + 1 = [MASK]
        self.token = nn.Embedding(vocab_size, args["bert_hidden_units"], padding_idx=0)
        self.position = nn.Embedding(args["bert_max_len"], args["bert_hidden_units"])
        self.transformer_blocks = nn.ModuleList([
            TransformerBlock(args["bert_hidden_units"], args["bert_num_heads"], args["bert_hidden_units"] * 4, args["bert_dropout"])
            for _ in range(args["bert_num_blocks"])])
        self.out = nn.Linear(args["bert_hidden_units"], args["num_items"] + 1)

    def forward(self, x):
        mask = (x > 0).unsqueeze(1).repeat(1, x.size(1), 1).unsqueeze(1)
        h = self.token(x) + self.position.weight.unsqueeze(0)[:, : x.size(1)]
        for transformer in self.transformer_blocks:
            h = transformer.forward(h, mask)
        return self.out(h)


def main():
    torch.manual_seed(0)
    args = dict(num_items=50, bert_max_len=10, bert_hidden_units=32, bert_num_heads=4, bert_num_blocks=2, bert_dropout=0.1)
    model = BERT(args).eval()
    mask_token = args["num_items"] + 1
    histories = [[3, 17, 9, 22, 41, 5, 8, 30, 12, 7, 19], [4, 11, 2], [25, 26, 27, 28, 29, 31]]
    seqs = []
    for items in histories:
        # BertEvalDataset: append [MASK] for the next item, keep the last max_len, pad on the left.
        tokens = (items + [mask_token])[-args["bert_max_len"]:]
        tokens = [0] * (args["bert_max_len"] - len(tokens)) + tokens
        seqs.append(tokens)
    seqs = torch.tensor(seqs)
    with torch.no_grad():
        scores = model(seqs)[:, -1, :]
    print("next-item top-3:", scores.topk(3, dim=-1).indices.tolist())


if __name__ == "__main__":
    main()
