# Citation: jaywonchung/BERT4Rec-VAE-Pytorch models/bert_modules/bert.py (BERT.forward mask), commit
#   ff1d49d3c297206278650d01b2d6cff003b341ea; models/bert_modules/attention/single.py (Attention: masked_fill(mask == 0,
#   -1e9)); dataloaders/bert.py (BertTrainDataset / BertEvalDataset: histories LEFT-padded with 0, [MASK] = num_items+1);
#   trainers/bert.py (CrossEntropyLoss(ignore_index=0), eval scores[:, -1, :]).
# Bidirectional sequential recommender: 0/1 key-padding mask (x > 0) repeated over query rows, shape (B,1,T,T), so every
# real item attends to every real item (cloze training needs both directions) and never to left padding. Pad query rows
# still see the real keys; their outputs carry label 0 (ignored) and eval reads only the last, real, [MASK] position.
import argparse
import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
random.seed(0)


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


class GELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = GELU()

    def forward(self, x):
        return self.w_2(self.dropout(self.activation(self.w_1(x))))


class SublayerConnection(nn.Module):
    def __init__(self, size, dropout):
        super().__init__()
        self.norm = nn.LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


class TransformerBlock(nn.Module):
    def __init__(self, hidden, attn_heads, feed_forward_hidden, dropout):
        super().__init__()
        self.attention = MultiHeadedAttention(h=attn_heads, d_model=hidden, dropout=dropout)
        self.feed_forward = PositionwiseFeedForward(d_model=hidden, d_ff=feed_forward_hidden, dropout=dropout)
        self.input_sublayer = SublayerConnection(size=hidden, dropout=dropout)
        self.output_sublayer = SublayerConnection(size=hidden, dropout=dropout)
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, x, mask):
        x = self.input_sublayer(x, lambda _x: self.attention.forward(_x, _x, _x, mask=mask))
        x = self.output_sublayer(x, self.feed_forward)
        return self.dropout(x)


class BERTEmbedding(nn.Module):
    def __init__(self, vocab_size, embed_size, max_len, dropout=0.1):
        super().__init__()
        self.token = nn.Embedding(vocab_size, embed_size, padding_idx=0)
        self.position = nn.Embedding(max_len, embed_size)  # PositionalEmbedding
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, sequence):
        pos = self.position.weight.unsqueeze(0).repeat(sequence.size(0), 1, 1)
        return self.dropout(self.token(sequence) + pos)


class BERT(nn.Module):
    def __init__(self, args):
        super().__init__()
        max_len = args.bert_max_len
        num_items = args.bert_num_items
        n_layers = args.bert_num_blocks
        heads = args.bert_num_heads
        vocab_size = num_items + 2
        hidden = args.bert_hidden_units
        self.hidden = hidden
        dropout = args.bert_dropout
        self.embedding = BERTEmbedding(vocab_size=vocab_size, embed_size=self.hidden, max_len=max_len, dropout=dropout)
        self.transformer_blocks = nn.ModuleList(
            [TransformerBlock(hidden, heads, hidden * 4, dropout) for _ in range(n_layers)])

    def forward(self, x):
        mask = (x > 0).unsqueeze(1).repeat(1, x.size(1), 1).unsqueeze(1)
        x = self.embedding(x)
        for transformer in self.transformer_blocks:
            x = transformer.forward(x, mask)
        return x


class BERTModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.bert = BERT(args)
        self.out = nn.Linear(self.bert.hidden, args.num_items + 1)

    def forward(self, x):
        x = self.bert(x)
        return self.out(x)


def train_item(seq, max_len, mask_prob, mask_token, num_items, rng):
    tokens, labels = [], []
    for s in seq:
        prob = rng.random()
        if prob < mask_prob:
            prob /= mask_prob
            if prob < 0.8:
                tokens.append(mask_token)
            elif prob < 0.9:
                tokens.append(rng.randint(1, num_items))
            else:
                tokens.append(s)
            labels.append(s)
        else:
            tokens.append(s)
            labels.append(0)
    tokens = tokens[-max_len:]
    labels = labels[-max_len:]
    mask_len = max_len - len(tokens)
    tokens = [0] * mask_len + tokens
    labels = [0] * mask_len + labels
    return torch.LongTensor(tokens), torch.LongTensor(labels)


def eval_item(seq, max_len, mask_token):
    seq = seq + [mask_token]
    seq = seq[-max_len:]
    padding_len = max_len - len(seq)
    seq = [0] * padding_len + seq
    return torch.LongTensor(seq)


args = argparse.Namespace(bert_max_len=16, bert_num_items=40, num_items=40, bert_num_blocks=2, bert_num_heads=2,
                          bert_hidden_units=32, bert_dropout=0.1, bert_mask_prob=0.3)
mask_token = args.num_items + 1
user_seqs = [[random.randint(1, 40) for _ in range(n)] for n in (20, 9, 4, 13)]
batch = [train_item(s, args.bert_max_len, args.bert_mask_prob, mask_token, args.num_items, random) for s in user_seqs]
seqs = torch.stack([b[0] for b in batch])
labels = torch.stack([b[1] for b in batch])
labels[:, -1] = torch.tensor([s[-1] for s in user_seqs])  # make sure every row has a target
seqs[:, -1] = mask_token

model = BERTModel(args)
ce = nn.CrossEntropyLoss(ignore_index=0)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
model.train()
for step in range(3):
    logits = model(seqs)  # B x T x V
    loss = ce(logits.view(-1, logits.size(-1)), labels.view(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

model.eval()
with torch.no_grad():
    eval_seqs = torch.stack([eval_item(s[:-1], args.bert_max_len, mask_token) for s in user_seqs])
    scores = model(eval_seqs)[:, -1, :]  # B x V
    candidates = torch.randint(1, 41, (4, 10))
    cand_scores = scores.gather(1, candidates)
print(f"loss={loss.item():.4f} cand_norm={cand_scores.norm().item():.4f}")
