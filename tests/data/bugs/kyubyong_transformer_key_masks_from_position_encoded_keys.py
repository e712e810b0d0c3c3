"""Kyubyong/transformer (TF1) multihead_attention: key padding mask derived from keys that carry positional encoding.

Citation: Kyubyong/transformer PR #69 ("fix the mask problem for multi-head attenion", merged 2019-01). The PR
description was read; the pre-fix `multihead_attention` key-masking lines were read in stored copies of the
code; the PR's diff was not read, so the fixed lines below are reconstructed from its description. Ported from
TensorFlow 1 to torch (tf.split/concat over heads -> view/cat, tf.where -> torch.where).

Bug: the encoder never receives the padding; `multihead_attention` infers it from the key vectors,
`key_masks = tf.sign(tf.abs(tf.reduce_sum(keys, axis=-1)))`, i.e. a key is padding where its vector sums to 0.
The `<PAD>` (id 0) embedding row is zero (zero_pad=True), but train.py adds the positional encoding to it
(`self.enc += positional_encoding(...)`) before the blocks, so padded keys are never all-zero and nothing is
masked: every real query attends to the padding of its sentence. (Second point of the PR: summing before
abs can also zero out a real key.)

Fix (per the PR description): build the mask before positional encoding is added, with abs before the sum,
`tf.sign(tf.reduce_sum(tf.abs(emb), axis=-1))`, and hand it to multihead_attention as `key_masks`.

This program runs the encoder on a right-padded batch of two source sentences (lengths 6 and 3, maxlen 6).
"""
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class Hyperparams:
    maxlen = 6
    hidden_units = 16
    num_blocks = 2
    num_heads = 4
    dropout_rate = 0.1
    sinusoid = True


hp = Hyperparams


def embedding(vocab_size, num_units):
    table = nn.Embedding(vocab_size, num_units)
    with torch.no_grad():
        table.weight[0].zero_()  # zero_pad=True: id 0 (<PAD>) looks up zeros
    return table


def positional_encoding(inputs, num_units):
    N, T = inputs.shape
    position_enc = torch.tensor([[pos / math.pow(10000, 2. * i / num_units) for i in range(num_units)]
                                 for pos in range(T)])
    position_enc[:, 0::2] = torch.sin(position_enc[:, 0::2])
    position_enc[:, 1::2] = torch.cos(position_enc[:, 1::2])
    return position_enc.unsqueeze(0).expand(N, T, num_units)


class MultiheadAttention(nn.Module):
    def __init__(self, num_units, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.Q = nn.Linear(num_units, num_units)
        self.K = nn.Linear(num_units, num_units)
        self.V = nn.Linear(num_units, num_units)
        self.ln = nn.LayerNorm(num_units)

    def forward(self, queries, keys, key_masks=None):
        h = self.num_heads
        Q, K, V = self.Q(queries), self.K(keys), self.V(keys)
        # Split and concat: (h*N, T, C/h), heads stacked on the batch axis as tf.concat(tf.split(...), 0)
        Q_ = torch.cat(torch.chunk(Q, h, dim=2), dim=0)
        K_ = torch.cat(torch.chunk(K, h, dim=2), dim=0)
        V_ = torch.cat(torch.chunk(V, h, dim=2), dim=0)

        outputs = torch.matmul(Q_, K_.transpose(1, 2))  # (h*N, T_q, T_k)
        outputs = outputs / (K_.shape[-1] ** 0.5)

        # Key Masking
        if key_masks is None:
            key_masks = torch.sign(torch.abs(torch.sum(keys, dim=-1)))  # (N, T_k)
        key_masks = key_masks.repeat(h, 1)  # (h*N, T_k)
        key_masks = key_masks.unsqueeze(1).repeat(1, queries.shape[1], 1)  # (h*N, T_q, T_k)
        paddings = torch.ones_like(outputs) * (-2 ** 32 + 1)
        outputs = torch.where(key_masks == 0, paddings, outputs)

        outputs = torch.softmax(outputs, dim=-1)

        # Query Masking
        query_masks = torch.sign(torch.abs(torch.sum(queries, dim=-1)))  # (N, T_q)
        query_masks = query_masks.repeat(h, 1).unsqueeze(-1)
        outputs = outputs * query_masks

        outputs = torch.matmul(outputs, V_)
        outputs = torch.cat(torch.chunk(outputs, h, dim=0), dim=2)  # (N, T_q, C)
        outputs = outputs + queries
        return self.ln(outputs)


class Encoder(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.enc_embed = embedding(vocab_size, hp.hidden_units)
        self.blocks = nn.ModuleList(MultiheadAttention(hp.hidden_units, hp.num_heads) for _ in range(hp.num_blocks))
        self.ff = nn.ModuleList(nn.Sequential(nn.Linear(hp.hidden_units, 4 * hp.hidden_units), nn.ReLU(),
                                              nn.Linear(4 * hp.hidden_units, hp.hidden_units))
                                for _ in range(hp.num_blocks))
        self.dropout = nn.Dropout(hp.dropout_rate)

    def forward(self, x):
        ## Embedding
        enc = self.enc_embed(x) * (hp.hidden_units ** 0.5)
        key_masks = None
        if FIXED:
            key_masks = torch.sign(torch.sum(torch.abs(enc), dim=-1))  # before positional encoding
        ## Positional Encoding
        if hp.sinusoid:
            enc = enc + positional_encoding(x, hp.hidden_units)
        ## Dropout
        enc = self.dropout(enc)
        ## Blocks
        for attn, ff in zip(self.blocks, self.ff):
            enc = attn(queries=enc, keys=enc, key_masks=key_masks)
            enc = enc + ff(enc)
        return enc


if __name__ == "__main__":
    torch.manual_seed(0)
    # right-padded source batch, <PAD> = 0
    x = torch.tensor([[5, 9, 3, 7, 2, 4],
                      [8, 6, 2, 0, 0, 0]])
    model = Encoder(vocab_size=10).eval()
    with torch.no_grad():
        enc = model(x)
    print("fixed" if FIXED else "buggy", tuple(enc.shape), f"{enc[1, 0].sum().item():.4f} {enc[1, 0, 0].item():.4f}")
