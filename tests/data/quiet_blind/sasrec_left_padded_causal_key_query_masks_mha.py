"""SASRec sequential recommendation: left-padded histories, causal + key masks as one 3-D float mask for MHA.

Follows kang205/SASRec modules.py (multihead_attention: key masks where the key embedding is all zero, filled with
-2**32+1; causality via a lower-triangular matrix; query masks multiplying the outputs of padded queries by 0)
and pmixer/SASRec.pytorch model.py (SASRec.log2feats with torch.nn.MultiheadAttention, sequence-first tensors,
item_emb with padding_idx=0, positions 1..maxlen zeroed on padding, histories padded on the LEFT so that the
last position is the most recent item; predict scores items from log_feats[:, -1, :]).

Mask meant: a float (batch*heads, T, T) mask: 0 where key j <= query i and j is a real item, -2**32+1 elsewhere.
Padded query rows (left of the first real item) see only padding: their softmax is uniform over the
masked keys and their outputs are zeroed by the query mask afterwards, as in the original; nothing reads them.
The attention weights are requested (`need_weights=True`) to report the most attended past item.
"""
import argparse

import numpy as np
import torch
import torch.nn as nn

NEG = -2 ** 32 + 1


class PointWiseFeedForward(nn.Module):
    def __init__(self, hidden_units, dropout_rate):
        super().__init__()
        self.conv1 = nn.Conv1d(hidden_units, hidden_units, kernel_size=1)
        self.dropout1 = nn.Dropout(p=dropout_rate)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv1d(hidden_units, hidden_units, kernel_size=1)
        self.dropout2 = nn.Dropout(p=dropout_rate)

    def forward(self, inputs):
        outputs = self.dropout2(self.conv2(self.relu(self.dropout1(self.conv1(inputs.transpose(-1, -2))))))
        return outputs.transpose(-1, -2) + inputs


class SASRec(nn.Module):
    def __init__(self, user_num, item_num, args):
        super().__init__()
        self.item_num = item_num
        self.num_heads = args.num_heads
        self.item_emb = nn.Embedding(item_num + 1, args.hidden_units, padding_idx=0)
        self.pos_emb = nn.Embedding(args.maxlen + 1, args.hidden_units, padding_idx=0)
        self.emb_dropout = nn.Dropout(p=args.dropout_rate)
        self.attention_layernorms = nn.ModuleList()
        self.attention_layers = nn.ModuleList()
        self.forward_layernorms = nn.ModuleList()
        self.forward_layers = nn.ModuleList()
        self.last_layernorm = nn.LayerNorm(args.hidden_units, eps=1e-8)
        for _ in range(args.num_blocks):
            self.attention_layernorms.append(nn.LayerNorm(args.hidden_units, eps=1e-8))
            self.attention_layers.append(nn.MultiheadAttention(args.hidden_units, args.num_heads, args.dropout_rate))
            self.forward_layernorms.append(nn.LayerNorm(args.hidden_units, eps=1e-8))
            self.forward_layers.append(PointWiseFeedForward(args.hidden_units, args.dropout_rate))
        self.last_weights = None

    def log2feats(self, log_seqs):
        seqs = self.item_emb(torch.LongTensor(log_seqs))
        seqs *= self.item_emb.embedding_dim ** 0.5
        poss = np.tile(np.arange(1, log_seqs.shape[1] + 1), [log_seqs.shape[0], 1])
        poss *= (log_seqs != 0)
        seqs += self.pos_emb(torch.LongTensor(poss))
        seqs = self.emb_dropout(seqs)

        timeline_mask = torch.BoolTensor(log_seqs == 0)
        tl = seqs.shape[1]
        causal = torch.tril(torch.ones((tl, tl), dtype=torch.bool))
        # key masks and causality as in modules.multihead_attention, one mask per (sequence, head)
        allowed = causal[None] & ~timeline_mask[:, None, :]
        attention_mask = torch.zeros(allowed.shape).masked_fill(~allowed, NEG)
        attention_mask = attention_mask.repeat_interleave(self.num_heads, dim=0)

        for i in range(len(self.attention_layers)):
            seqs = torch.transpose(seqs, 0, 1)
            Q = self.attention_layernorms[i](seqs)
            mha_outputs, weights = self.attention_layers[i](Q, seqs, seqs, attn_mask=attention_mask,
                                                            need_weights=True)
            self.last_weights = weights
            seqs = Q + mha_outputs
            seqs = torch.transpose(seqs, 0, 1)
            seqs *= ~timeline_mask.unsqueeze(-1)  # query masks
            seqs = self.forward_layernorms[i](seqs)
            seqs = self.forward_layers[i](seqs)
            seqs *= ~timeline_mask.unsqueeze(-1)
        return self.last_layernorm(seqs)

    def predict(self, user_ids, log_seqs, item_indices):
        log_feats = self.log2feats(log_seqs)
        final_feat = log_feats[:, -1, :]
        item_embs = self.item_emb(torch.LongTensor(item_indices))
        return item_embs.matmul(final_feat.unsqueeze(-1)).squeeze(-1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--maxlen', default=8, type=int)
    parser.add_argument('--hidden_units', default=16, type=int)
    parser.add_argument('--num_blocks', default=2, type=int)
    parser.add_argument('--num_heads', default=2, type=int)
    parser.add_argument('--dropout_rate', default=0.2, type=float)
    args = parser.parse_args([])

    torch.manual_seed(0)
    np.random.seed(0)
    model = SASRec(user_num=3, item_num=30, args=args).eval()
    histories = [[3, 7, 9, 11, 4, 2, 8], [5, 6], [12, 13, 14, 15]]
    log_seqs = np.zeros((len(histories), args.maxlen), dtype=np.int64)
    for u, h in enumerate(histories):
        h = h[-args.maxlen:]
        log_seqs[u, args.maxlen - len(h):] = h  # left padding: most recent item last
    item_indices = np.tile(np.arange(1, 11), (len(histories), 1))
    with torch.no_grad():
        scores = model.predict(np.arange(3), log_seqs, item_indices)
    most_attended = model.last_weights[:, -1].argmax(-1)
    assert all(log_seqs[u, most_attended[u]] != 0 for u in range(len(histories)))
    print(scores.argmax(-1).tolist(), most_attended.tolist())


if __name__ == "__main__":
    main()
