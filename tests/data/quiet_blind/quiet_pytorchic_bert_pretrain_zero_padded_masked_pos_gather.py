# Correct program (quiet batch quiet-r81a).
# Ported from dhlee347/pytorchic-bert:
#   models.py @24375eadf1d2014d582f39591efcafbc75b7bbec (Config, LayerNorm, Embeddings, MultiHeadedSelfAttention with
#     `scores -= 10000.0 * (1.0 - mask[:, None, None, :].float())`, PositionWiseFeedForward, Block, Transformer),
#   utils.py @723de2023875913ca02fe3e6ba0f9708f2904c2c (split_last, merge_last, truncate_tokens_pair),
#   pretrain.py @07eeeafc3abddfc668f6103eac448530223eded8 (Preprocess4Pretrain: [CLS] a [SEP] b [SEP], segment ids,
#     input_mask of ones then zero padding to max_len, masked_pos / masked_ids / masked_weights zero-padded to
#     max_pred; BertModel4Pretrain: pooled [CLS] for next-sentence classification, gather of h at masked_pos for the
#     tied-decoder masked LM; get_loss: per-prediction CE times masked_weights, plus the NSP CE).
# One change from pretrain.py: its candidate filter compares the whole list (`tokens != '[CLS]'`); written here with
# `token`, as intended, so [CLS] / [SEP] are never picked. Sentences come from a tiny word list instead of a corpus
# file, and the tokenizer is a dict lookup.
# Every instance is zero-padded to max_len (right padding, id 0) with input_mask 0 on the pads; each layer subtracts
# 10000 from the scores of pad keys. Self-check: every instance alone, cut to its real length and run with mask=None,
# must give the same hidden states at its real tokens, the same MLM logits at its masked positions, the same NSP
# logits, and the same losses as a double loop over the predictions.
import math
import random
from random import randint, shuffle
from random import random as rand
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


# --- utils.py ---
def split_last(x, shape):
    "split the last dimension to given shape"
    shape = list(shape)
    assert shape.count(-1) <= 1
    if -1 in shape:
        shape[shape.index(-1)] = int(x.size(-1) / -np.prod(shape))
    return x.view(*x.size()[:-1], *shape)


def merge_last(x, n_dims):
    "merge the last n_dims to a dimension"
    s = x.size()
    assert n_dims > 1 and n_dims < len(s)
    return x.view(*s[:-n_dims], -1)


def truncate_tokens_pair(tokens_a, tokens_b, max_len):
    while True:
        if len(tokens_a) + len(tokens_b) <= max_len:
            break
        if len(tokens_a) > len(tokens_b):
            tokens_a.pop()
        else:
            tokens_b.pop()


def get_random_word(vocab_words):
    i = random.randint(0, len(vocab_words) - 1)
    return vocab_words[i]


# --- models.py ---
class Config(NamedTuple):
    "Configuration for BERT model"
    vocab_size: int = None
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    dim_ff: int = 768 * 4
    p_drop_hidden: float = 0.1
    p_drop_attn: float = 0.1
    max_len: int = 512
    n_seg: int = 2


def gelu(x):
    "Implementation of the gelu activation function by Hugging Face"
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class LayerNorm(nn.Module):
    "A layernorm module in the TF style (epsilon inside the square root)."
    def __init__(self, cfg, variance_epsilon=1e-12):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(cfg.dim))
        self.beta = nn.Parameter(torch.zeros(cfg.dim))
        self.variance_epsilon = variance_epsilon

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.gamma * x + self.beta


class Embeddings(nn.Module):
    "The embedding module from word, position and token_type embeddings."
    def __init__(self, cfg):
        super().__init__()
        self.tok_embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embed = nn.Embedding(cfg.max_len, cfg.dim)
        self.seg_embed = nn.Embedding(cfg.n_seg, cfg.dim)
        self.norm = LayerNorm(cfg)
        self.drop = nn.Dropout(cfg.p_drop_hidden)

    def forward(self, x, seg):
        seq_len = x.size(1)
        pos = torch.arange(seq_len, dtype=torch.long, device=x.device)
        pos = pos.unsqueeze(0).expand_as(x)  # (S,) -> (B, S)
        e = self.tok_embed(x) + self.pos_embed(pos) + self.seg_embed(seg)
        return self.drop(self.norm(e))


class MultiHeadedSelfAttention(nn.Module):
    """ Multi-Headed Dot Product Attention """
    def __init__(self, cfg):
        super().__init__()
        self.proj_q = nn.Linear(cfg.dim, cfg.dim)
        self.proj_k = nn.Linear(cfg.dim, cfg.dim)
        self.proj_v = nn.Linear(cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.p_drop_attn)
        self.scores = None  # for visualization
        self.n_heads = cfg.n_heads

    def forward(self, x, mask):
        q, k, v = self.proj_q(x), self.proj_k(x), self.proj_v(x)
        q, k, v = (split_last(x, (self.n_heads, -1)).transpose(1, 2) for x in [q, k, v])
        scores = q @ k.transpose(-2, -1) / np.sqrt(k.size(-1))
        if mask is not None:
            mask = mask[:, None, None, :].float()
            scores -= 10000.0 * (1.0 - mask)
        scores = self.drop(F.softmax(scores, dim=-1))
        h = (scores @ v).transpose(1, 2).contiguous()
        self.scores = scores
        return merge_last(h, 2)


class PositionWiseFeedForward(nn.Module):
    """ FeedForward Neural Networks for each position """
    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.dim_ff)
        self.fc2 = nn.Linear(cfg.dim_ff, cfg.dim)

    def forward(self, x):
        return self.fc2(gelu(self.fc1(x)))


class Block(nn.Module):
    """ Transformer Block """
    def __init__(self, cfg):
        super().__init__()
        self.attn = MultiHeadedSelfAttention(cfg)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm1 = LayerNorm(cfg)
        self.pwff = PositionWiseFeedForward(cfg)
        self.norm2 = LayerNorm(cfg)
        self.drop = nn.Dropout(cfg.p_drop_hidden)

    def forward(self, x, mask):
        h = self.attn(x, mask)
        h = self.norm1(x + self.drop(self.proj(h)))
        h = self.norm2(h + self.drop(self.pwff(h)))
        return h


class Transformer(nn.Module):
    """ Transformer with Self-Attentive Blocks"""
    def __init__(self, cfg):
        super().__init__()
        self.embed = Embeddings(cfg)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])

    def forward(self, x, seg, mask):
        h = self.embed(x, seg)
        for block in self.blocks:
            h = block(h, mask)
        return h


# --- pretrain.py ---
class Preprocess4Pretrain:
    """ Pre-processing steps for pretraining transformer """
    def __init__(self, max_pred, mask_prob, vocab_words, indexer, max_len=512):
        self.max_len = max_len
        self.max_pred = max_pred
        self.mask_prob = mask_prob
        self.vocab_words = vocab_words
        self.indexer = indexer

    def __call__(self, instance):
        is_next, tokens_a, tokens_b = instance

        # -3  for special tokens [CLS], [SEP], [SEP]
        truncate_tokens_pair(tokens_a, tokens_b, self.max_len - 3)

        tokens = ['[CLS]'] + tokens_a + ['[SEP]'] + tokens_b + ['[SEP]']
        segment_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
        input_mask = [1] * len(tokens)

        masked_tokens, masked_pos = [], []
        n_pred = min(self.max_pred, max(1, int(round(len(tokens) * self.mask_prob))))
        cand_pos = [i for i, token in enumerate(tokens)
                    if token != '[CLS]' and token != '[SEP]']
        shuffle(cand_pos)
        for pos in cand_pos[:n_pred]:
            masked_tokens.append(tokens[pos])
            masked_pos.append(pos)
            if rand() < 0.8:  # 80%
                tokens[pos] = '[MASK]'
            elif rand() < 0.5:  # 10%
                tokens[pos] = get_random_word(self.vocab_words)
        masked_weights = [1] * len(masked_tokens)

        input_ids = self.indexer(tokens)
        masked_ids = self.indexer(masked_tokens)

        # Zero Padding
        n_pad = self.max_len - len(input_ids)
        input_ids.extend([0] * n_pad)
        segment_ids.extend([0] * n_pad)
        input_mask.extend([0] * n_pad)

        # Zero Padding for masked target
        if self.max_pred > n_pred:
            n_pad = self.max_pred - n_pred
            masked_ids.extend([0] * n_pad)
            masked_pos.extend([0] * n_pad)
            masked_weights.extend([0] * n_pad)

        return (input_ids, segment_ids, input_mask, masked_ids, masked_pos, masked_weights, is_next)


class BertModel4Pretrain(nn.Module):
    "Bert Model for Pretrain : Masked LM and next sentence classification"
    def __init__(self, cfg):
        super().__init__()
        self.transformer = Transformer(cfg)
        self.fc = nn.Linear(cfg.dim, cfg.dim)
        self.activ1 = nn.Tanh()
        self.linear = nn.Linear(cfg.dim, cfg.dim)
        self.activ2 = gelu
        self.norm = LayerNorm(cfg)
        self.classifier = nn.Linear(cfg.dim, 2)
        embed_weight = self.transformer.embed.tok_embed.weight
        n_vocab, n_dim = embed_weight.size()
        self.decoder = nn.Linear(n_dim, n_vocab, bias=False)
        self.decoder.weight = embed_weight
        self.decoder_bias = nn.Parameter(torch.zeros(n_vocab))

    def forward(self, input_ids, segment_ids, input_mask, masked_pos):
        h = self.transformer(input_ids, segment_ids, input_mask)
        pooled_h = self.activ1(self.fc(h[:, 0]))
        masked_pos = masked_pos[:, :, None].expand(-1, -1, h.size(-1))
        h_masked = torch.gather(h, 1, masked_pos)
        h_masked = self.norm(self.activ2(self.linear(h_masked)))
        logits_lm = self.decoder(h_masked) + self.decoder_bias
        logits_clsf = self.classifier(pooled_h)
        return logits_lm, logits_clsf


def main():
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)

    words = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + [f"w{i}" for i in range(40)]
    vocab = {w: i for i, w in enumerate(words)}
    indexer = lambda toks: [vocab[t] for t in toks]
    max_len, max_pred, mask_prob = 24, 4, 0.15

    cfg = Config(vocab_size=len(words), dim=32, n_layers=2, n_heads=4, dim_ff=64, max_len=max_len)
    model = BertModel4Pretrain(cfg)
    model.eval()  # dropout off so the padded and the alone runs are comparable

    pipeline = [Preprocess4Pretrain(max_pred, mask_prob, words[5:], indexer, max_len)]
    lengths = [(3, 4), (9, 8), (2, 2), (6, 10), (5, 3)]
    batch = []
    for la, lb in lengths:
        tokens_a = [f"w{randint(0, 39)}" for _ in range(la)]
        tokens_b = [f"w{randint(0, 39)}" for _ in range(lb)]
        instance = (rand() < 0.5, tokens_a, tokens_b)
        for proc in pipeline:
            instance = proc(instance)
        batch.append(instance)
    batch_tensors = [torch.tensor(x, dtype=torch.long) for x in zip(*batch)]
    input_ids, segment_ids, input_mask, masked_ids, masked_pos, masked_weights, is_next = batch_tensors
    assert (input_mask.sum(1) < max_len).all() and (masked_weights == 0).any()

    criterion1 = nn.CrossEntropyLoss(reduction='none')
    criterion2 = nn.CrossEntropyLoss()

    with torch.no_grad():
        h = model.transformer(input_ids, segment_ids, input_mask)
        logits_lm, logits_clsf = model(input_ids, segment_ids, input_mask, masked_pos)
        loss_lm = criterion1(logits_lm.transpose(1, 2), masked_ids)
        loss_lm = (loss_lm * masked_weights.float()).mean()
        loss_clsf = criterion2(logits_clsf, is_next)

        # reference: each instance alone, cut to its real length, no mask at all
        ref_lm_terms, ref_clsf_terms = [], []
        for b in range(len(batch)):
            n = int(input_mask[b].sum())
            ids_b, seg_b = input_ids[b:b + 1, :n], segment_ids[b:b + 1, :n]
            h_b = model.transformer(ids_b, seg_b, None)
            assert torch.allclose(h[b, :n], h_b[0], atol=1e-5), f"hidden states of instance {b}"
            pooled = model.activ1(model.fc(h_b[0, 0]))
            clsf = model.classifier(pooled)
            assert torch.allclose(logits_clsf[b], clsf, atol=1e-5), f"NSP logits of instance {b}"
            ref_clsf_terms.append(F.cross_entropy(clsf[None], is_next[b:b + 1]))
            for j in range(max_pred):
                if masked_weights[b, j] == 0:
                    ref_lm_terms.append(torch.tensor(0.0))
                    continue
                p = int(masked_pos[b, j])
                assert p < n
                hm = model.norm(model.activ2(model.linear(h_b[0, p])))
                lm = model.decoder(hm) + model.decoder_bias
                assert torch.allclose(logits_lm[b, j], lm, atol=1e-4), f"MLM logits of instance {b}, prediction {j}"
                ref_lm_terms.append(F.cross_entropy(lm[None], masked_ids[b, j:j + 1]))
        ref_loss_lm = torch.stack(ref_lm_terms).sum() / (len(batch) * max_pred)
        ref_loss_clsf = torch.stack(ref_clsf_terms).mean()
        assert torch.allclose(loss_lm, ref_loss_lm, atol=1e-5), (loss_lm, ref_loss_lm)
        assert torch.allclose(loss_clsf, ref_loss_clsf, atol=1e-5), (loss_clsf, ref_loss_clsf)
    print(f"ok: {len(batch)} zero-padded instances match their unpadded runs; "
          f"loss_lm {loss_lm.item():.4f} loss_clsf {loss_clsf.item():.4f}")


if __name__ == '__main__':
    main()
