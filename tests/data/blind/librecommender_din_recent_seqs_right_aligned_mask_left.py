# massquantity/LibRecommender#310 (commit e7766ef, "Fix mask order in sequence"): get_recent_seqs /
# get_interacted_seq wrote a short history at the END of the pad-filled row (`seqs[u, -len:]`) while DIN builds its
# key mask with tf.sequence_mask(len, max_seq_len) (first `len` slots valid), so attention pooled pad slots and
# dropped the real items; the fix writes the history at the start (`seqs[u, :len]`). TF code ported to torch.
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
np.random.seed(0)


# libreco/batch/sequence.py: most recent num items a user has interacted, assume already sorted by time.
def get_recent_seqs(n_users, user_consumed, pad_index, max_seq_len, dtype):
    recent_seqs = np.full((n_users, max_seq_len), pad_index, dtype=np.int32)
    recent_seq_lens = []
    for u in range(n_users):
        u_consumed_items = user_consumed[u]
        u_items_len = len(u_consumed_items)
        if u_items_len < max_seq_len:
            if FIXED:
                recent_seqs[u, :u_items_len] = u_consumed_items
            else:
                recent_seqs[u, -u_items_len:] = u_consumed_items
            recent_seq_lens.append(float(u_items_len))
        else:
            recent_seqs[u] = u_consumed_items[-max_seq_len:]
            recent_seq_lens.append(float(max_seq_len))
    oov = np.full(max_seq_len, pad_index, dtype=np.int32)
    recent_seqs = np.vstack([recent_seqs, oov])
    recent_seq_lens = np.append(recent_seq_lens, [1])
    return recent_seqs, np.array(recent_seq_lens).astype(dtype)


def sequence_mask(lengths, maxlen):  # tf.sequence_mask
    return torch.arange(maxlen)[None, :] < lengths[:, None]


class DIN(nn.Module):
    """libreco.algorithms.DIN (user/item id features, item-id behaviour sequence), use_tf_attention=True."""

    def __init__(self, n_users, n_items, embed_size=8, max_seq_len=6, hidden_units=(16, 8), use_tf_attention=True):
        super().__init__()
        self.n_items = n_items
        self.max_seq_len = max_seq_len
        self.use_tf_attention = use_tf_attention
        self.user_embed = nn.Embedding(n_users + 1, embed_size)
        self.item_embed = nn.Embedding(n_items + 1, embed_size)  # row n_items is pad_index
        layers, dim = [], 3 * embed_size
        for h in hidden_units:
            layers += [nn.Linear(dim, h), nn.ReLU()]
            dim = h
        self.dense = nn.Sequential(*layers, nn.Linear(dim, 1))

    def _attention_unit(self, queries, keys, keys_len):
        if self.use_tf_attention:
            key_masks = sequence_mask(keys_len, self.max_seq_len)
            queries = queries.unsqueeze(1)  # B * 1 * K
            # tf.keras.layers.Attention(use_scale=False)(inputs=[queries, keys], mask=[query_masks, key_masks])
            pooled_outputs = F.scaled_dot_product_attention(queries, keys, keys, attn_mask=key_masks.unsqueeze(1), scale=1.0)
            return pooled_outputs  # B * 1 * K
        raise NotImplementedError

    def forward(self, user_indices, item_indices, user_interacted_seq, user_interacted_len):
        item_total_embed = self.item_embed(item_indices)  # B * K
        seq_total_embed = self.item_embed(user_interacted_seq)  # B * seq * K
        attention_layer = self._attention_unit(item_total_embed, seq_total_embed, user_interacted_len)
        concat_embed = torch.cat([self.user_embed(user_indices), item_total_embed, attention_layer.flatten(1)], dim=1)
        return self.dense(concat_embed).squeeze(-1)


n_users, n_items, max_seq_len = 4, 30, 6
# user -> consumed items sorted by time (users 0, 2 and 3 have fewer than max_seq_len items)
user_consumed = {0: [3, 7, 11], 1: [1, 2, 5, 8, 13, 21, 22, 25], 2: [4, 9], 3: [6, 10, 12, 14, 17]}
recent_seqs, recent_seq_lens = get_recent_seqs(n_users, user_consumed, n_items, max_seq_len, np.float32)

model = DIN(n_users, n_items, max_seq_len=max_seq_len).eval()
# recommend_user: score every item for each user with the user's recent sequence
users = torch.arange(n_users)
with torch.no_grad():
    scores = []
    for u in users.tolist():
        items = torch.arange(n_items)
        seq = torch.as_tensor(recent_seqs[u], dtype=torch.long).repeat(n_items, 1)
        seq_len = torch.as_tensor(recent_seq_lens[u]).repeat(n_items)
        scores.append(model(torch.full((n_items,), u), items, seq, seq_len))
    scores = torch.stack(scores)
print("mode:", "fixed" if FIXED else "buggy")
print("recent_seqs row 0:", recent_seqs[0].tolist(), "len:", recent_seq_lens[0])
print("top-3 items per user:", scores.topk(3, dim=1).indices.tolist())
print("user 0 score of item 0: %.4f" % scores[0, 0].item())
