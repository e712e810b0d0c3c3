# THUwangcy/ReChorus commit dba1d0b ("optimize implementations of SASRec and TiSASRec").
#
# ReChorus' SASRec encodes a user's item history (right-padded with item id 0, most recent item at
# index lengths-1, reversed position ids) and scores candidate items with the hidden state of the most
# recent item.  Before dba1d0b the self-attention mask was built from the history's padding only
# (`1 - valid_his`, every real item attends to every real item, later ones included), so a stacked
# SASRec is bidirectional over the history.  dba1d0b replaced it with a lower-triangular causality
# mask (`np.tril`), the commented-out padding mask `valid_his.view(batch_size, 1, 1, seq_len)` left
# beside it.  This file keeps the post-commit layer layout (utils/layers.py TransformerLayer) and runs
# the pre-commit mask (padding keys only) without --fixed, the causality mask with --fixed.
import sys

import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


# ---- src/utils/layers.py ----------------------------------------------------------------------
class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads, kq_same=False, bias=True):
        super().__init__()
        self.d_model = d_model
        self.h = n_heads
        self.d_k = self.d_model // self.h
        self.kq_same = kq_same

        self.v_linear = nn.Linear(d_model, d_model, bias=bias)
        self.k_linear = nn.Linear(d_model, d_model, bias=bias)
        if not kq_same:
            self.q_linear = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, q, k, v, mask):
        bs = q.size(0)

        k = self.k_linear(k).view(bs, -1, self.h, self.d_k)
        if not self.kq_same:
            q = self.q_linear(q).view(bs, -1, self.h, self.d_k)
        else:
            q = self.k_linear(q).view(bs, -1, self.h, self.d_k)
        v = self.v_linear(v).view(bs, -1, self.h, self.d_k)

        k = k.transpose(1, 2)
        q = q.transpose(1, 2)
        v = v.transpose(1, 2)

        output = self.scaled_dot_product_attention(q, k, v, self.d_k, mask)

        output = output.transpose(1, 2).reshape(bs, -1, self.d_model)
        return output

    @staticmethod
    def scaled_dot_product_attention(q, k, v, d_k, mask):
        scores = torch.matmul(q, k.transpose(-2, -1)) / d_k ** 0.5  # bs, head, q_len, k_len
        scores.masked_fill_(mask == 0, -np.inf)
        scores = (scores - scores.max()).softmax(dim=-1)
        output = torch.matmul(scores, v)  # bs, head, q_len, d_k
        return output


class TransformerLayer(nn.Module):
    def __init__(self, d_model, d_ff, n_heads, dropout, kq_same=False):
        super().__init__()
        self.masked_attn_head = MultiHeadAttention(d_model, n_heads, kq_same=kq_same)
        self.layer_norm1 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.layer_norm2 = nn.LayerNorm(d_model)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, seq, mask):
        context = self.masked_attn_head(seq, seq, seq, mask)
        context = self.layer_norm1(self.dropout1(context) + seq)
        output = self.linear1(context).relu()
        output = self.linear2(output)
        output = self.layer_norm2(self.dropout2(output) + context)
        return output


# ---- src/models/sequential/SASRec.py ------------------------------------------------------------
class Args:
    emb_size = 16
    num_layers = 2
    num_heads = 4
    dropout = 0.0
    history_max = 6


class Corpus:
    n_items = 30


class SASRec(nn.Module):
    def __init__(self, args, corpus):
        super().__init__()
        self.emb_size = args.emb_size
        self.dropout = args.dropout
        self.item_num = corpus.n_items
        self.max_his = args.history_max
        self.num_layers = args.num_layers
        self.num_heads = args.num_heads
        self.device = torch.device("cpu")
        self._define_params()
        self.len_range = torch.from_numpy(np.arange(self.max_his)).to(self.device)

    def _define_params(self):
        self.i_embeddings = nn.Embedding(self.item_num, self.emb_size)
        self.p_embeddings = nn.Embedding(self.max_his + 1, self.emb_size)

        self.transformer_block = nn.ModuleList([
            TransformerLayer(d_model=self.emb_size, d_ff=self.emb_size, n_heads=self.num_heads,
                             dropout=self.dropout, kq_same=False)
            for _ in range(self.num_layers)
        ])

    def forward(self, feed_dict):
        self.check_list = []
        i_ids = feed_dict['item_id']  # [batch_size, -1]
        history = feed_dict['history_items']  # [batch_size, history_max]
        lengths = feed_dict['lengths']  # [batch_size]
        batch_size, seq_len = history.shape

        valid_his = (history > 0).long()
        his_vectors = self.i_embeddings(history)

        # Position embedding
        # lengths:  [4, 2, 5]
        # position: [[4, 3, 2, 1, 0], [2, 1, 0, 0, 0], [5, 4, 3, 2, 1]]
        position = (lengths[:, None] - self.len_range[None, :seq_len]) * valid_his
        pos_vectors = self.p_embeddings(position)
        his_vectors = his_vectors + pos_vectors

        # Self-attention
        if FIXED:
            causality_mask = np.tril(np.ones((1, 1, seq_len, seq_len), dtype=np.int64))
            attn_mask = torch.from_numpy(causality_mask).to(self.device)
        else:
            attn_mask = valid_his.view(batch_size, 1, 1, seq_len)
        for block in self.transformer_block:
            his_vectors = block(his_vectors, attn_mask)
        his_vectors = his_vectors * valid_his[:, :, None].float()

        his_vector = (his_vectors * (position == 1).float()[:, :, None]).sum(1)

        i_vectors = self.i_embeddings(i_ids)
        prediction = (his_vector[:, None, :] * i_vectors).sum(-1)
        return prediction.view(batch_size, -1)

    def loss(self, predictions):
        # BaseModel.loss: BPR over the target (column 0) and the sampled negatives
        pos_pred, neg_pred = predictions[:, 0], predictions[:, 1:]
        neg_softmax = (neg_pred - neg_pred.max()).softmax(dim=1)
        return -((pos_pred[:, None] - neg_pred).sigmoid() * neg_softmax).sum(dim=1).log().mean()


def collate(histories, targets, negatives, history_max):
    # SequentialModel.Dataset._get_feed_dict + BaseModel.Dataset.collate_batch: histories are the
    # last `history_max` items in time order, padded with 0 on the right by pad_sequence.
    his = [torch.tensor(h[-history_max:]) for h in histories]
    lengths = torch.tensor([len(h) for h in his])
    history_items = nn.utils.rnn.pad_sequence(his, batch_first=True, padding_value=0)
    item_id = torch.tensor([[t] + n for t, n in zip(targets, negatives)])
    return {'item_id': item_id, 'history_items': history_items, 'lengths': lengths,
            'batch_size': len(histories), 'phase': 'train'}


def main():
    torch.manual_seed(0)
    np.random.seed(0)
    model = SASRec(Args(), Corpus())
    model.eval()

    histories = [[3, 7, 12, 5, 9], [4, 21], [8, 2, 17, 11]]
    targets = [14, 6, 25]
    negatives = [[1, 19], [28, 13], [10, 22]]
    feed_dict = collate(histories, targets, negatives, Args.history_max)

    with torch.no_grad():
        prediction = model(feed_dict)
        loss = model.loss(prediction)
    np.set_printoptions(precision=5, suppress=True)
    print("fixed" if FIXED else "buggy")
    print("history_items:\n", feed_dict['history_items'].numpy())
    print("scores [target, neg, neg]:\n", prediction.numpy())
    print("bpr loss: %.6f" % loss.item())


if __name__ == "__main__":
    main()
