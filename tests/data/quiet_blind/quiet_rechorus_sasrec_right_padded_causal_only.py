# Correct program (quiet batch quiet-r66a).
# Citation: THUwangcy/ReChorus @e58d752558634d42be60de561d6f74df748583cc
#   src/models/sequential/SASRec.py (SASRecBase._base_define_params, SASRecBase.forward),
#   src/utils/layers.py (MultiHeadAttention.head_split / forward / scaled_dot_product_attention, TransformerLayer),
#   src/models/BaseModel.py (BaseModel.init_weights, BaseModel.Dataset.collate_batch with pad_sequence,
#   SequentialModel.Dataset._get_feed_dict, GeneralModel.loss).
# Each user's history (oldest first, the last history_max items) is collated with pad_sequence(batch_first=True),
# so shorter histories are padded with item 0 on the RIGHT. Positions count back from the most recent item
# ((lengths - idx) * valid_his, 0 on pads). The only attention mask is the causal tril (1, 1, L, L): with right
# padding a real query at t < length sees keys 0..t, all real, so no key padding mask is needed; pad rows are
# zeroed by `* valid_his` and the user vector is read at lengths - 1. (`np.int` / `np.object` upstream are written
# `int` / `object`: the aliases are gone from numpy; init_weights' std is 0.3, not 0.01, so the check is not
# near-trivial.) The check: predictions and BPR loss equal a reference that runs each user's history
# alone, unpadded, with a per-query loop that softmaxes over keys 0..t only.
from argparse import Namespace
from typing import List

import numpy as np
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence

torch.manual_seed(0)
np.random.seed(0)
torch.set_default_dtype(torch.float64)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads, kq_same=False, bias=True, attention_d=-1):
        super().__init__()
        self.d_model = d_model
        self.h = n_heads
        self.attention_d = self.d_model if attention_d < 0 else attention_d
        self.d_k = self.attention_d // self.h
        self.kq_same = kq_same
        if not kq_same:
            self.q_linear = nn.Linear(d_model, self.attention_d, bias=bias)
        self.k_linear = nn.Linear(d_model, self.attention_d, bias=bias)
        self.v_linear = nn.Linear(d_model, self.attention_d, bias=bias)

    def head_split(self, x):  # get dimensions bs * h * seq_len * d_k
        new_x_shape = x.size()[:-1] + (self.h, self.d_k)
        return x.view(*new_x_shape).transpose(-2, -3)

    def forward(self, q, k, v, mask=None):
        origin_shape = q.size()
        if not self.kq_same:
            q = self.head_split(self.q_linear(q))
        else:
            q = self.head_split(self.k_linear(q))
        k = self.head_split(self.k_linear(k))
        v = self.head_split(self.v_linear(v))
        output = self.scaled_dot_product_attention(q, k, v, self.d_k, mask)
        output = output.transpose(-2, -3).reshape(list(origin_shape)[:-1] + [self.attention_d])
        return output

    @staticmethod
    def scaled_dot_product_attention(q, k, v, d_k, mask=None):
        scores = torch.matmul(q, k.transpose(-2, -1)) / d_k ** 0.5  # bs, head, q_len, k_len
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -np.inf)
        scores = (scores - scores.max()).softmax(dim=-1)
        scores = scores.masked_fill(torch.isnan(scores), 0)
        output = torch.matmul(scores, v)  # bs, head, q_len, d_k
        return output


class TransformerLayer(nn.Module):
    def __init__(self, d_model, d_ff, n_heads, dropout=0, kq_same=False):
        super().__init__()
        self.masked_attn_head = MultiHeadAttention(d_model, n_heads, kq_same=kq_same)
        self.layer_norm1 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.layer_norm2 = nn.LayerNorm(d_model)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, seq, mask=None):
        context = self.masked_attn_head(seq, seq, seq, mask)
        context = self.layer_norm1(self.dropout1(context) + seq)
        output = self.linear1(context).relu()
        output = self.linear2(output)
        output = self.layer_norm2(self.dropout2(output) + context)
        return output


class SASRec(nn.Module):
    def __init__(self, args, corpus):
        super().__init__()
        self.device = args.device
        self.item_num = corpus.n_items
        self.dropout = args.dropout
        self.emb_size = args.emb_size
        self.max_his = args.history_max
        self.num_layers = args.num_layers
        self.num_heads = args.num_heads
        self.len_range = torch.from_numpy(np.arange(self.max_his)).to(self.device)
        self._base_define_params()
        self.apply(self.init_weights)

    @staticmethod
    def init_weights(m):
        if 'Linear' in str(type(m)):
            nn.init.normal_(m.weight, mean=0.0, std=0.3)
            if m.bias is not None:
                nn.init.normal_(m.bias, mean=0.0, std=0.3)
        elif 'Embedding' in str(type(m)):
            nn.init.normal_(m.weight, mean=0.0, std=0.3)

    def _base_define_params(self):
        self.i_embeddings = nn.Embedding(self.item_num, self.emb_size)
        self.p_embeddings = nn.Embedding(self.max_his + 1, self.emb_size)
        self.transformer_block = nn.ModuleList([
            TransformerLayer(d_model=self.emb_size, d_ff=self.emb_size, n_heads=self.num_heads,
                             dropout=self.dropout, kq_same=False)
            for _ in range(self.num_layers)
        ])

    def forward(self, feed_dict):
        i_ids = feed_dict['item_id']  # [batch_size, -1]
        history = feed_dict['history_items']  # [batch_size, history_max]
        lengths = feed_dict['lengths']  # [batch_size]
        batch_size, seq_len = history.shape

        valid_his = (history > 0).long()
        his_vectors = self.i_embeddings(history)

        # position: [[4, 3, 2, 1, 0], [2, 1, 0, 0, 0], [5, 4, 3, 2, 1]]
        position = (lengths[:, None] - self.len_range[None, :seq_len]) * valid_his
        pos_vectors = self.p_embeddings(position)
        his_vectors = his_vectors + pos_vectors

        # Self-attention
        causality_mask = np.tril(np.ones((1, 1, seq_len, seq_len), dtype=int))
        attn_mask = torch.from_numpy(causality_mask).to(self.device)
        for block in self.transformer_block:
            his_vectors = block(his_vectors, attn_mask)
        his_vectors = his_vectors * valid_his[:, :, None].float()

        his_vector = his_vectors[torch.arange(batch_size), lengths - 1, :]

        i_vectors = self.i_embeddings(i_ids)
        prediction = (his_vector[:, None, :] * i_vectors).sum(-1)
        return {'prediction': prediction.view(batch_size, -1)}

    def loss(self, out_dict):
        predictions = out_dict['prediction']
        pos_pred, neg_pred = predictions[:, 0], predictions[:, 1:]
        neg_softmax = (neg_pred - neg_pred.max()).softmax(dim=1)
        loss = -(((pos_pred[:, None] - neg_pred).sigmoid() * neg_softmax).sum(dim=1)).clamp(min=1e-8, max=1 - 1e-8).log().mean()
        return loss


def collate_batch(feed_dicts: List[dict]) -> dict:
    feed_dict = dict()
    for key in feed_dicts[0]:
        if isinstance(feed_dicts[0][key], np.ndarray):
            tmp_list = [len(d[key]) for d in feed_dicts]
            if any([tmp_list[0] != l for l in tmp_list]):
                stack_val = np.array([d[key] for d in feed_dicts], dtype=object)
            else:
                stack_val = np.array([d[key] for d in feed_dicts])
        else:
            stack_val = np.array([d[key] for d in feed_dicts])
        if stack_val.dtype == object:  # inconsistent length (e.g., history)
            feed_dict[key] = pad_sequence([torch.from_numpy(x) for x in stack_val], batch_first=True)
        else:
            feed_dict[key] = torch.from_numpy(stack_val)
    feed_dict['batch_size'] = len(feed_dicts)
    return feed_dict


args = Namespace(device='cpu', dropout=0.0, emb_size=16, history_max=8, num_layers=2, num_heads=2, num_neg=3)
corpus = Namespace(n_items=40)
model = SASRec(args, corpus).eval()

# SequentialModel.Dataset._get_feed_dict: the last history_max items before the target, oldest first.
user_his = {u: list(np.random.randint(1, corpus.n_items, size=n)) for u, n in zip(range(1, 5), [11, 3, 6, 2])}
feed_dicts = []
for u, seq in user_his.items():
    target, his = seq[-1], seq[:-1]
    his = his[-args.history_max:]
    neg = np.random.randint(1, corpus.n_items, size=args.num_neg)
    feed_dicts.append({'user_id': u, 'item_id': np.concatenate([[target], neg]).astype(int),
                       'history_items': np.array(his), 'lengths': len(his)})
batch = collate_batch(feed_dicts)
with torch.no_grad():
    out = model(batch)
    loss = model.loss(out)


def reference_user(fd):
    """One user's history alone (no padding), attention written as a loop over queries, keys 0..t only."""
    his = torch.from_numpy(fd['history_items'])
    n = len(his)
    x = model.i_embeddings(his) + model.p_embeddings(torch.arange(n, 0, -1))
    for block in model.transformer_block:
        att = block.masked_attn_head
        q = att.q_linear(x).view(n, att.h, att.d_k)
        k = att.k_linear(x).view(n, att.h, att.d_k)
        v = att.v_linear(x).view(n, att.h, att.d_k)
        ctx = torch.zeros(n, att.h, att.d_k)
        for t in range(n):
            for h in range(att.h):
                w = torch.softmax(k[: t + 1, h] @ q[t, h] / att.d_k ** 0.5, dim=0)
                ctx[t, h] = w @ v[: t + 1, h]
        ctx = block.layer_norm1(ctx.reshape(n, -1) + x)
        x = block.layer_norm2(block.linear2(block.linear1(ctx).relu()) + ctx)
    user = x[n - 1]
    return model.i_embeddings(torch.from_numpy(fd['item_id'])) @ user


with torch.no_grad():
    ref = torch.stack([reference_user(fd) for fd in feed_dicts])
    ref_loss = model.loss({'prediction': ref})
worst = max((out['prediction'] - ref).abs().max().item(), abs(loss.item() - ref_loss.item()))
print("history lengths", batch['lengths'].tolist(), "padded width", batch['history_items'].shape[1],
      "loss %.6f" % loss.item(), "max diff %.2e" % worst)
assert worst < 1e-10, worst
