# dbiir/UER-py#190 (commit 22147b5, "fix bug that mean-pooling includes pad embedding"), scripts/extract_features.py.
# FeatureExtractor zeroed the padded positions (output * seg) but then pooled with torch.mean(output, dim=1), so the
# mean divided by seq_length (the padded length) instead of the number of real tokens: a sentence vector shrinks
# with the amount of padding and its cosine similarity to other sentences changes with --seq_length.
# Fix: sum over dim 1 and divide by torch.sum(seg, dim=1), the count of real tokens.
# Ported from the bug state (scripts/extract_features.py, uer/encoders/transformer_encoder.py, uer/layers/*),
# BERT-style fully_visible encoder with the seg-derived additive mask, tiny sizes, random weights.
import argparse
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD_ID = 0
CLS_ID = 2


class LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super(LayerNorm, self).__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(hidden_size))
        self.beta = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        hidden_states = self.gamma * (x - mean) / (std + self.eps)
        return hidden_states + self.beta


class WordPosSegEmbedding(nn.Module):
    def __init__(self, args, vocab_size):
        super(WordPosSegEmbedding, self).__init__()
        self.remove_embedding_layernorm = args.remove_embedding_layernorm
        self.dropout = nn.Dropout(args.dropout)
        self.max_seq_length = args.max_seq_length
        self.word_embedding = nn.Embedding(vocab_size, args.emb_size)
        self.position_embedding = nn.Embedding(self.max_seq_length, args.emb_size)
        self.segment_embedding = nn.Embedding(3, args.emb_size)
        if not self.remove_embedding_layernorm:
            self.layer_norm = LayerNorm(args.emb_size)

    def forward(self, src, seg):
        word_emb = self.word_embedding(src)
        pos_emb = self.position_embedding(
            torch.arange(0, word_emb.size(1), device=word_emb.device, dtype=torch.long)
            .unsqueeze(0)
            .repeat(word_emb.size(0), 1)
        )
        seg_emb = self.segment_embedding(seg)
        emb = word_emb + pos_emb + seg_emb
        if not self.remove_embedding_layernorm:
            emb = self.layer_norm(emb)
        emb = self.dropout(emb)
        return emb


class MultiHeadedAttention(nn.Module):
    def __init__(self, hidden_size, heads_num, attention_head_size, dropout, has_bias=True, with_scale=True):
        super(MultiHeadedAttention, self).__init__()
        self.heads_num = heads_num
        self.per_head_size = attention_head_size
        self.with_scale = with_scale
        self.inner_hidden_size = heads_num * attention_head_size
        self.linear_layers = nn.ModuleList(
            [nn.Linear(hidden_size, self.inner_hidden_size, bias=has_bias) for _ in range(3)]
        )
        self.dropout = nn.Dropout(dropout)
        self.final_linear = nn.Linear(self.inner_hidden_size, hidden_size, bias=has_bias)

    def forward(self, key, value, query, mask, position_bias=None, has_residual_attention=False, prev_attn=None):
        batch_size, seq_length, _ = query.size()
        heads_num = self.heads_num
        per_head_size = self.per_head_size

        def unshape(x):
            return x.transpose(1, 2).contiguous().view(batch_size, seq_length, self.inner_hidden_size)

        query, key, value = [l(x).view(batch_size, -1, heads_num, per_head_size).transpose(1, 2)
                             for l, x in zip(self.linear_layers, (query, key, value))]

        scores = torch.matmul(query, key.transpose(-2, -1))
        if position_bias is not None:
            scores = scores + position_bias
        if self.with_scale:
            scores = scores / math.sqrt(float(per_head_size))
        scores = scores + mask.type_as(scores)
        prev_attn_out = None
        probs = nn.Softmax(dim=-1)(scores)
        probs = self.dropout(probs)
        output = unshape(torch.matmul(probs, value))
        output = self.final_linear(output)
        return output, prev_attn_out


class PositionwiseFeedForward(nn.Module):
    def __init__(self, hidden_size, feedforward_size, hidden_act, has_bias=True):
        super(PositionwiseFeedForward, self).__init__()
        self.linear_1 = nn.Linear(hidden_size, feedforward_size, bias=has_bias)
        self.linear_2 = nn.Linear(feedforward_size, hidden_size, bias=has_bias)
        self.act = nn.functional.gelu

    def forward(self, x):
        return self.linear_2(self.act(self.linear_1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, args):
        super(TransformerLayer, self).__init__()
        self.layernorm_positioning = args.layernorm_positioning
        attention_head_size = args.hidden_size // args.heads_num
        has_bias = bool(1 - args.remove_transformer_bias)
        with_scale = bool(1 - args.remove_attention_scale)
        self.self_attn = MultiHeadedAttention(
            args.hidden_size, args.heads_num, attention_head_size, args.dropout, has_bias=has_bias, with_scale=with_scale
        )
        self.dropout_1 = nn.Dropout(args.dropout)
        self.feed_forward = PositionwiseFeedForward(args.hidden_size, args.feedforward_size, args.hidden_act, has_bias)
        self.dropout_2 = nn.Dropout(args.dropout)
        self.layer_norm_1 = LayerNorm(args.hidden_size)
        self.layer_norm_2 = LayerNorm(args.hidden_size)

    def forward(self, hidden, mask, position_bias=None, has_residual_attention=False, prev_attn=None):
        inter, prev_attn_out = self.self_attn(hidden, hidden, hidden, mask, position_bias, has_residual_attention, prev_attn)
        inter = self.dropout_1(inter)
        inter = self.layer_norm_1(inter + hidden)
        output = self.dropout_2(self.feed_forward(inter))
        output = self.layer_norm_2(output + inter)
        return output, prev_attn_out


class TransformerEncoder(nn.Module):
    """
    BERT encoder exploits 12 or 24 transformer layers to extract features.
    """
    def __init__(self, args):
        super(TransformerEncoder, self).__init__()
        self.mask = args.mask
        self.layers_num = args.layers_num
        self.transformer = nn.ModuleList([TransformerLayer(args) for _ in range(self.layers_num)])

    def forward(self, emb, seg):
        batch_size, seq_length, _ = emb.size()
        # Generate mask according to segment indicators.
        # mask: [batch_size x 1 x seq_length x seq_length]
        if self.mask == "fully_visible":
            mask = (seg > 0). \
                unsqueeze(1). \
                repeat(1, seq_length, 1). \
                unsqueeze(1)
            mask = mask.float()
            mask = (1.0 - mask) * -10000.0
        else:
            mask = torch.ones(seq_length, seq_length, device=emb.device)
            mask = torch.tril(mask)
            mask = (1.0 - mask) * -10000
            mask = mask.repeat(batch_size, 1, 1, 1)

        hidden = emb
        prev_attn = None
        for i in range(self.layers_num):
            hidden, prev_attn = self.transformer[i](hidden, mask, prev_attn=prev_attn)
        return hidden


def batch_loader(batch_size, src, seg):
    instances_num = src.size(0)
    for i in range(instances_num // batch_size):
        src_batch = src[i * batch_size : (i + 1) * batch_size]
        seg_batch = seg[i * batch_size : (i + 1) * batch_size]
        yield src_batch, seg_batch
    if instances_num > instances_num // batch_size * batch_size:
        src_batch = src[instances_num // batch_size * batch_size:]
        seg_batch = seg[instances_num // batch_size * batch_size:]
        yield src_batch, seg_batch


def read_dataset(args, lines):
    dataset = []
    for line in lines:
        src = line  # already token ids
        if len(src) == 0:
            continue
        src = [CLS_ID] + src
        seg = [1] * len(src)
        if len(src) > args.seq_length:
            src = src[:args.seq_length]
            seg = seg[:args.seq_length]
        while len(src) < args.seq_length:
            src.append(PAD_ID)
            seg.append(PAD_ID)
        dataset.append((src, seg))
    return dataset


class FeatureExtractor(torch.nn.Module):
    def __init__(self, args):
        super(FeatureExtractor, self).__init__()
        self.embedding = WordPosSegEmbedding(args, args.vocab_size)
        self.encoder = TransformerEncoder(args)
        self.pooling = args.pooling

    def forward(self, src, seg):
        emb = self.embedding(src, seg)
        output = self.encoder(emb, seg)
        seg = torch.unsqueeze(seg, dim=-1)
        output = output * seg

        if self.pooling == "mean":
            if FIXED:
                output = torch.sum(output, dim=1)
                output = torch.div(output, torch.sum(seg, dim=1))
            else:
                output = torch.mean(output, dim=1)
        elif self.pooling == "max":
            output = torch.max(output, dim=1)[0]
        elif self.pooling == "last":
            output = output[:, -1, :]
        else:
            output = output[:, 0, :]

        return output


if __name__ == '__main__':
    args = argparse.Namespace(
        vocab_size=40, emb_size=32, hidden_size=32, heads_num=4, feedforward_size=64, layers_num=2,
        max_seq_length=16, seq_length=12, dropout=0.1, remove_embedding_layernorm=False,
        layernorm_positioning="post", remove_transformer_bias=False, remove_attention_scale=False,
        hidden_act="gelu", mask="fully_visible", pooling="mean", batch_size=2,
    )
    lines = [[5, 9, 11, 7], [5, 9, 11, 7, 13, 21, 30, 8, 17, 4], [22, 6, 19], [14, 25, 33, 12, 27, 10, 9]]
    dataset = read_dataset(args, lines)
    src = torch.LongTensor([sample[0] for sample in dataset])
    seg = torch.LongTensor([sample[1] for sample in dataset])

    model = FeatureExtractor(args)
    model.eval()

    vectors = []
    with torch.no_grad():
        for src_batch, seg_batch in batch_loader(args.batch_size, src, seg):
            output = model(src_batch, seg_batch)
            vectors.append(output)
    vectors = torch.cat(vectors, 0)
    print("vector norms:", [round(v, 4) for v in vectors.norm(dim=-1).tolist()])
    sims = torch.nn.functional.cosine_similarity(vectors[0:1], vectors[1:], dim=-1)
    print("cosine(sentence 0, others):", [round(s, 4) for s in sims.tolist()])
