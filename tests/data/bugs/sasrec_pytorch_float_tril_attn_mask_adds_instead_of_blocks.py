# pmixer/SASRec.pytorch commit aab3261: the causal mask was `torch.tril(torch.ones((tl, tl)))`, a float mask that
# nn.MultiheadAttention adds to the scores (+1 / +0), so no future item is blocked; fixed to `~torch.tril(bool)`.
import sys
from types import SimpleNamespace

import numpy as np
import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
np.random.seed(0)


class PointWiseFeedForward(torch.nn.Module):
    def __init__(self, hidden_units, dropout_rate):
        super(PointWiseFeedForward, self).__init__()
        self.conv1 = torch.nn.Conv1d(hidden_units, hidden_units, kernel_size=1)
        self.dropout1 = torch.nn.Dropout(p=dropout_rate)
        self.relu = torch.nn.ReLU()
        self.conv2 = torch.nn.Conv1d(hidden_units, hidden_units, kernel_size=1)
        self.dropout2 = torch.nn.Dropout(p=dropout_rate)

    def forward(self, inputs):
        outputs = self.dropout2(self.conv2(self.relu(self.dropout1(self.conv1(inputs.transpose(-1, -2))))))
        outputs = outputs.transpose(-1, -2)  # as Conv1D requires (N, C, Length)
        outputs += inputs
        return outputs


class SASRec(torch.nn.Module):
    def __init__(self, user_num, item_num, args):
        super(SASRec, self).__init__()
        self.user_num = user_num
        self.item_num = item_num
        self.item_emb = torch.nn.Embedding(self.item_num + 1, args.hidden_units, padding_idx=0)
        self.pos_emb = torch.nn.Embedding(args.maxlen, args.hidden_units)
        self.emb_dropout = torch.nn.Dropout(p=args.dropout_rate)
        self.attention_layernorms = torch.nn.ModuleList()
        self.attention_layers = torch.nn.ModuleList()
        self.forward_layernorms = torch.nn.ModuleList()
        self.forward_layers = torch.nn.ModuleList()
        self.last_layernorm = torch.nn.LayerNorm(args.hidden_units, eps=1e-8)
        for _ in range(args.num_blocks):
            self.attention_layernorms.append(torch.nn.LayerNorm(args.hidden_units, eps=1e-8))
            self.attention_layers.append(torch.nn.MultiheadAttention(args.hidden_units, args.num_heads, args.dropout_rate))
            self.forward_layernorms.append(torch.nn.LayerNorm(args.hidden_units, eps=1e-8))
            self.forward_layers.append(PointWiseFeedForward(args.hidden_units, args.dropout_rate))

    def log2feats(self, log_seqs):
        seqs = self.item_emb(torch.LongTensor(log_seqs))
        seqs *= self.item_emb.embedding_dim ** 0.5
        positions = np.tile(np.array(range(log_seqs.shape[1])), [log_seqs.shape[0], 1])
        seqs += self.pos_emb(torch.LongTensor(positions))
        seqs = self.emb_dropout(seqs)

        timeline_mask = torch.BoolTensor(log_seqs == 0)
        seqs *= ~timeline_mask.unsqueeze(-1)  # broadcast in last dim

        tl = seqs.shape[1]  # time dim len for enforce causality
        if FIXED:
            attention_mask = ~torch.tril(torch.ones((tl, tl), dtype=torch.bool))
        else:
            attention_mask = torch.tril(torch.ones((tl, tl)))

        for i in range(len(self.attention_layers)):
            seqs = torch.transpose(seqs, 0, 1)  # (N, T, C) -> (T, N, C)
            Q = self.attention_layernorms[i](seqs)
            mha_outputs, _ = self.attention_layers[i](Q, seqs, seqs, attn_mask=attention_mask)
            seqs = Q + mha_outputs
            seqs = torch.transpose(seqs, 0, 1)  # (T, N, C) -> (N, T, C)
            seqs = self.forward_layernorms[i](seqs)
            seqs = self.forward_layers[i](seqs)
            seqs *= ~timeline_mask.unsqueeze(-1)
        return self.last_layernorm(seqs)

    def forward(self, user_ids, log_seqs, pos_seqs, neg_seqs):  # for training
        log_feats = self.log2feats(log_seqs)
        pos_logits = (log_feats * self.item_emb(torch.LongTensor(pos_seqs))).sum(dim=-1)
        neg_logits = (log_feats * self.item_emb(torch.LongTensor(neg_seqs))).sum(dim=-1)
        return pos_logits, neg_logits


args = SimpleNamespace(hidden_units=16, maxlen=8, num_blocks=2, num_heads=1, dropout_rate=0.0)
model = SASRec(user_num=2, item_num=40, args=args).eval()

# Left-padded user histories; the target at each step is the next item (pos_seqs = log_seqs shifted by one).
log_seqs = np.array([[0, 0, 3, 7, 12, 5, 9, 21], [4, 8, 15, 16, 23, 30, 2, 11]])
pos_seqs = np.array([[0, 3, 7, 12, 5, 9, 21, 33], [8, 15, 16, 23, 30, 2, 11, 6]])
neg_seqs = np.random.randint(1, 41, size=log_seqs.shape)

with torch.no_grad():
    pos_logits, _ = model(np.arange(2), log_seqs, pos_seqs, neg_seqs)
    # A causal recommender's logit at step t must not depend on items after t: change the last 4 items.
    changed = log_seqs.copy()
    changed[:, 4:] = [[1, 2, 3, 4], [5, 6, 7, 8]]
    pos_logits2, _ = model(np.arange(2), changed, pos_seqs, neg_seqs)
print(f"fixed={FIXED}: change of step<4 logits when only later items change = "
      f"{(pos_logits[:, :4] - pos_logits2[:, :4]).abs().max().item():.3e}")
