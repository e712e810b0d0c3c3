"""Kyubyong/transformer (TF1 tutorial Transformer): key masks read from embeddings that already hold the PE.

Citation: Kyubyong/transformer#33 ("does the key masking work?") and the merged PR #69 ("fix the mask problem
for multi-head attenion"). I read both descriptions (and #3's discussion); I did not read #69's diff, so the
fixed lines below follow its description.

Bug: ``multihead_attention`` derived its padding masks from the inputs themselves,
``key_masks = tf.sign(tf.abs(tf.reduce_sum(keys, axis=-1)))``. ``embedding(..., zero_pad=True)`` makes a
padding token's vector zero, but the encoder adds the positional encoding before the first attention block,
so no padded key sums to zero and every key mask is 1: queries attend to the padding.

Fix (#69): build the mask where padding is still zero, before the positional encoding is added, and take
``abs`` before the ``reduce_sum`` (so a real token whose components cancel is not masked either).

Reproduction: the TF1 ``embedding`` / ``positional_encoding`` / ``multihead_attention`` functions rendered in
torch, written as the repository's functional style (tile over heads, ``-2**32+1`` paddings, ``tf.where``).
A batch of two source sentences, right padded with id 0 to length 6.
"""
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class Hyperparams:
    """hyperparams.py"""

    maxlen = 6
    hidden_units = 16
    num_blocks = 1
    num_heads = 2
    dropout_rate = 0.0


hp = Hyperparams


def embedding(inputs, lookup_table, zero_pad=True, scale=True, num_units=hp.hidden_units):
    if zero_pad:
        lookup_table = torch.cat((torch.zeros(1, num_units), lookup_table[1:]), 0)
    outputs = lookup_table[inputs]
    if scale:
        outputs = outputs * (num_units ** 0.5)
    return outputs


def positional_encoding(inputs, num_units):
    N, T = inputs.shape
    position_ind = torch.arange(T)[None, :].expand(N, T)
    position_enc = torch.tensor([[pos / math.pow(10000, 2. * i / num_units) for i in range(num_units)]
                                 for pos in range(T)])
    position_enc[:, 0::2] = torch.sin(position_enc[:, 0::2])  # dim 2i
    position_enc[:, 1::2] = torch.cos(position_enc[:, 1::2])  # dim 2i+1
    return position_enc[position_ind]


class MultiheadAttention(nn.Module):
    def __init__(self, num_units, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.Q = nn.Linear(num_units, num_units)
        self.K = nn.Linear(num_units, num_units)
        self.V = nn.Linear(num_units, num_units)

    def forward(self, queries, keys, causality=False, key_masks=None, query_masks=None):
        num_heads = self.num_heads
        Q = torch.relu(self.Q(queries))
        K = torch.relu(self.K(keys))
        V = torch.relu(self.V(keys))
        # Split and concat: (h*N, T, C/h)
        Q_ = torch.cat(torch.chunk(Q, num_heads, dim=2), dim=0)
        K_ = torch.cat(torch.chunk(K, num_heads, dim=2), dim=0)
        V_ = torch.cat(torch.chunk(V, num_heads, dim=2), dim=0)
        outputs = torch.matmul(Q_, K_.transpose(1, 2))
        outputs = outputs / (K_.shape[-1] ** 0.5)

        # Key Masking
        if key_masks is None:
            key_masks = torch.sign(torch.abs(torch.sum(keys, dim=-1)))  # (N, T_k)
        key_masks = key_masks.repeat(num_heads, 1)  # (h*N, T_k)
        key_masks = key_masks[:, None, :].expand(-1, queries.shape[1], -1)  # (h*N, T_q, T_k)
        paddings = torch.ones_like(outputs) * (-2 ** 32 + 1)
        outputs = torch.where(key_masks == 0, paddings, outputs)

        outputs = torch.softmax(outputs, dim=-1)

        # Query Masking
        if query_masks is None:
            query_masks = torch.sign(torch.abs(torch.sum(queries, dim=-1)))  # (N, T_q)
        query_masks = query_masks.repeat(num_heads, 1)[:, :, None].expand(-1, -1, keys.shape[1])
        outputs = outputs * query_masks

        outputs = torch.matmul(outputs, V_)
        outputs = torch.cat(torch.chunk(outputs, num_heads, dim=0), dim=2)
        return outputs + queries


def main():
    torch.manual_seed(0)
    vocab_size = 20
    lookup_table = torch.randn(vocab_size, hp.hidden_units)
    attention = MultiheadAttention(hp.hidden_units, hp.num_heads).eval()
    x = torch.tensor([[5, 9, 3, 14, 2, 0],
                      [7, 11, 0, 0, 0, 0]])  # source ids, 0 = <PAD>

    # Encoder
    enc = embedding(x, lookup_table, zero_pad=True, scale=True)
    masks = None
    if FIXED:
        # padding is still all-zero before the positional encoding; abs before the sum
        masks = torch.sign(torch.sum(torch.abs(enc), dim=-1))
    enc = enc + positional_encoding(x, num_units=hp.hidden_units)
    with torch.no_grad():
        for _ in range(hp.num_blocks):
            enc = attention(enc, enc, causality=False, key_masks=masks, query_masks=masks)
    print("enc[:, 0, :3]:", [[round(v, 4) for v in row[0, :3].tolist()] for row in enc])


if __name__ == "__main__":
    main()
