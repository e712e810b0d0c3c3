"""SASRec (TF reference implementation): key/query masks from sign(|sum(x)|) instead of sign(sum(|x|)).

Citation: kang205/SASRec#14 ("`tf.sign(tf.abs(tf.reduce_sum` vs `tf.sign(tf.reduce_sum(tf.abs(` for
generating masks?"), fixed by PR kang205/SASRec#15 (commit 2ebe5ca, merge 9c28faf) and the
follow-up typo fix for #17 (commit 777a3a6). Read in the upstream git history of modules.py.

Bug: `multihead_attention` infers which keys / queries are padding from the data:
`key_masks = tf.sign(tf.abs(tf.reduce_sum(keys, axis=-1)))` and the same for `queries`. A real
position whose vector happens to SUM to zero is treated as padding. The queries of every block
are `normalize(self.seq)` (layer norm with gamma=1, beta=0 at init), whose entries sum to zero
by construction, so in float32 a sizeable share of real item positions (about 8% at
hidden_units=50) get an exact 0.0 sum: their query mask is 0, their attention row is multiplied
by zero after the softmax ("Query Masking"), and they attend to nothing.
Fix: `tf.sign(tf.reduce_sum(tf.abs(keys), axis=-1))` (abs before the sum), i.e. a position is
padding only if its vector is all zeros.

This program: model.py / modules.py ported from TF1 to torch op by op (`tf.split`/`tf.concat`
heads onto the batch axis, `tf.where` with -2**32+1, lower-triangular causality, softmax, query
masking), argparse defaults of main.py (maxlen shortened to 10), random weights, 4 users with
left-padded histories as the sampler builds them, dropout off (inference).
"""
import argparse
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def normalize(inputs, epsilon=1e-8):
    mean = inputs.mean(-1, keepdim=True)
    variance = ((inputs - mean) ** 2).mean(-1, keepdim=True)  # tf.nn.moments
    beta = torch.zeros(inputs.shape[-1:])
    gamma = torch.ones(inputs.shape[-1:])
    normalized = (inputs - mean) / ((variance + epsilon) ** (.5))
    return gamma * normalized + beta


def padding_sign(x):
    if FIXED:
        return torch.sign(torch.sum(torch.abs(x), dim=-1))
    return torch.sign(torch.abs(torch.sum(x, dim=-1)))


class MultiheadAttention(nn.Module):
    def __init__(self, num_units, num_heads, causality):
        super().__init__()
        self.q = nn.Linear(num_units, num_units)
        self.k = nn.Linear(num_units, num_units)
        self.v = nn.Linear(num_units, num_units)
        self.num_heads = num_heads
        self.causality = causality

    def forward(self, queries, keys):
        num_heads = self.num_heads
        Q, K, V = self.q(queries), self.k(keys), self.v(keys)
        # Split and concat: (h*N, T, C/h)
        Q_ = torch.cat(torch.chunk(Q, num_heads, dim=2), dim=0)
        K_ = torch.cat(torch.chunk(K, num_heads, dim=2), dim=0)
        V_ = torch.cat(torch.chunk(V, num_heads, dim=2), dim=0)
        outputs = torch.matmul(Q_, K_.transpose(1, 2))
        outputs = outputs / (K_.shape[-1] ** 0.5)

        # Key Masking
        key_masks = padding_sign(keys)  # (N, T_k)
        key_masks = key_masks.repeat(num_heads, 1)  # (h*N, T_k)
        key_masks = key_masks.unsqueeze(1).repeat(1, queries.shape[1], 1)  # (h*N, T_q, T_k)
        paddings = torch.ones_like(outputs) * (-2 ** 32 + 1)
        outputs = torch.where(key_masks == 0, paddings, outputs)

        # Causality = Future blinding
        if self.causality:
            diag_vals = torch.ones_like(outputs[0, :, :])
            tril = torch.tril(diag_vals)
            masks = tril.unsqueeze(0).repeat(outputs.shape[0], 1, 1)
            paddings = torch.ones_like(masks) * (-2 ** 32 + 1)
            outputs = torch.where(masks == 0, paddings, outputs)

        outputs = torch.softmax(outputs, dim=-1)

        # Query Masking
        query_masks = padding_sign(queries)  # (N, T_q)
        query_masks = query_masks.repeat(num_heads, 1)
        query_masks = query_masks.unsqueeze(-1).repeat(1, 1, keys.shape[1])
        outputs = outputs * query_masks

        outputs = torch.matmul(outputs, V_)
        outputs = torch.cat(torch.chunk(outputs, num_heads, dim=0), dim=2)
        outputs = outputs + queries  # Residual connection
        return outputs, query_masks


class FeedForward(nn.Module):
    def __init__(self, num_units):
        super().__init__()
        self.conv1 = nn.Conv1d(num_units[1], num_units[0], 1)
        self.conv2 = nn.Conv1d(num_units[0], num_units[1], 1)

    def forward(self, inputs):
        outputs = torch.relu(self.conv1(inputs.transpose(1, 2)))
        outputs = self.conv2(outputs).transpose(1, 2)
        return outputs + inputs


class Model(nn.Module):
    def __init__(self, usernum, itemnum, args):
        super().__init__()
        self.args = args
        self.item_emb = nn.Embedding(itemnum + 1, args.hidden_units)
        self.pos_emb = nn.Embedding(args.maxlen, args.hidden_units)
        self.attn = nn.ModuleList(MultiheadAttention(args.hidden_units, args.num_heads, True) for _ in range(args.num_blocks))
        self.ff = nn.ModuleList(FeedForward([args.hidden_units, args.hidden_units]) for _ in range(args.num_blocks))

    def forward(self, input_seq):
        args = self.args
        mask = (input_seq != 0).float().unsqueeze(-1)
        # zero_pad=True: row 0 of the lookup table is zeros; scale=True
        table = torch.cat([torch.zeros(1, args.hidden_units), self.item_emb.weight[1:]], 0)
        seq = table[input_seq] * (args.hidden_units ** 0.5)
        seq = seq + self.pos_emb(torch.arange(input_seq.shape[1])).unsqueeze(0)
        seq = seq * mask
        query_masks = []
        for i in range(args.num_blocks):
            seq, qm = self.attn[i](queries=normalize(seq), keys=seq)
            query_masks.append(qm[:, :, 0])
            seq = self.ff[i](normalize(seq))
            seq = seq * mask
        return normalize(seq), query_masks


def main():
    torch.manual_seed(0)
    parser = argparse.ArgumentParser()
    parser.add_argument('--maxlen', default=10, type=int)
    parser.add_argument('--hidden_units', default=50, type=int)
    parser.add_argument('--num_blocks', default=2, type=int)
    parser.add_argument('--num_heads', default=1, type=int)
    parser.add_argument('--dropout_rate', default=0.5, type=float)
    args, _ = parser.parse_known_args()

    itemnum = 40
    histories = [[3, 7, 1, 9, 12, 30, 2, 5, 8, 11], [4, 6, 22], [15, 16, 17, 18, 19, 20], [33, 1, 2, 9, 25, 26, 27]]
    input_seq = torch.zeros(len(histories), args.maxlen, dtype=torch.long)
    for u, h in enumerate(histories):  # the sampler fills seq from the right
        input_seq[u, args.maxlen - len(h):] = torch.tensor(h)
    model = Model(len(histories), itemnum, args).eval()
    with torch.no_grad():
        seq_emb, query_masks = model(input_seq)
    real = input_seq != 0
    dropped = sum(int(((qm == 0) & real).sum()) for qm in query_masks)
    print("real item positions treated as padding queries:", dropped)
    # test_logits: last position against a few candidate items, as model.py scores them
    test_item = torch.tensor([1, 2, 3, 4])
    test_logits = seq_emb[:, -1] @ model.item_emb.weight[test_item].T
    print("test logits (user 0):", [round(v, 4) for v in test_logits[0].tolist()])


if __name__ == "__main__":
    main()
