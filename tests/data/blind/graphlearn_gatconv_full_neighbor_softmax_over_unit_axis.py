# alibaba/graph-learn#26 ("hg: Softmax on coefficients for each segment_id", commit c2cddc4, merged as d20edf7),
# graphlearn/python/model/tf/layers/gat_conv.py, ported from TensorFlow to torch.
#
# GATConv's "full neighbor" mode takes every neighbour of every batch node, flattened into one [total_nbrs, D] tensor
# with `segment_ids` saying which batch node each neighbour belongs to (a ragged neighbourhood, the stand-in for a
# padded neighbour mask). It scored each (node, neighbour) pair with `_attn_fc` (a Dense with one unit) and ran
# `tf.nn.softmax` over the last axis of that [total_nbrs, 1] tensor, so every coefficient came out 1.0 and the layer
# summed its neighbours with no attention, whatever their number. The fix exponentiates the scores and divides by
# their `tf.segment_sum` gathered back per neighbour: a softmax over each node's own neighbours.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def segment_sum(data, segment_ids):
    num_segments = int(segment_ids.max()) + 1
    out = torch.zeros((num_segments,) + data.shape[1:], dtype=data.dtype)
    return out.index_add_(0, segment_ids, data)


class GATConv(nn.Module):
    """Base GAT convolutional layer (full neighbor mode).

    Args:
      in_dim: Input dimension.
      out_dim: Output dimension.
      attn_drop: Dropout ratio for attention coefficients.
      act: Activation function.
    """

    def __init__(self, in_dim, out_dim, attn_drop, act=F.relu):
        super().__init__()
        self._fc = nn.Linear(in_dim, out_dim, bias=False)  # tf.keras.layers.Dense(units=out_dim, use_bias=False)
        self._attn_fc = nn.Linear(2 * out_dim, 1, bias=False)  # tf.keras.layers.Dense(units=1, use_bias=False)
        self._attn_drop = attn_drop
        self._activation = act

    def forward(self, self_vecs, neigh_vecs, segment_ids):
        """
        self_vecs: batch nodes' embedding vector, shape [B, D]
        neigh_vecs: corresponding neighbor nodes' embedding vector, shape [total_nbrs, D]
        segment_ids: segment ids indicates neighbor nodes' belonging, shape [total_nbrs]
        """
        self_vecs = self._fc(self_vecs)
        neigh_vecs = self._fc(neigh_vecs)
        # full neighbor GAT
        self_vecs_extend = self_vecs[segment_ids]  # tf.gather(self_vecs, segment_ids)
        if FIXED:
            coefficients = torch.exp(F.leaky_relu(self._attn_fc(
                torch.cat([self_vecs_extend, neigh_vecs], dim=-1)), negative_slope=0.2))
            seg_sum = segment_sum(coefficients, segment_ids)[segment_ids]
            coefficients = coefficients / seg_sum
        else:
            coefficients = torch.softmax(F.leaky_relu(self._attn_fc(
                torch.cat([self_vecs_extend, neigh_vecs], dim=-1)), negative_slope=0.2), dim=-1)
        coefficients = F.dropout(coefficients, self._attn_drop, training=self.training)
        neigh_vecs = coefficients * neigh_vecs
        neigh_vecs = segment_sum(neigh_vecs, segment_ids)

        if self._activation is not None:
            neigh_vecs = self._activation(neigh_vecs)
        return neigh_vecs


class MultiHeadGATConv(nn.Module):
    """Multi head GAT convolutional layer: the heads' outputs are averaged (concat=False)."""

    def __init__(self, in_dim, out_dim, num_head, attn_drop=0.0, concat=False, act=F.relu):
        super().__init__()
        self.gat_convs = nn.ModuleList([GATConv(in_dim, out_dim, attn_drop, act) for _ in range(num_head)])
        self._concat = concat

    def forward(self, self_vecs, neigh_vecs, sigment_ids=None):
        outputs = [conv(self_vecs, neigh_vecs, sigment_ids) for conv in self.gat_convs]
        if self._concat:
            return torch.cat(outputs, dim=-1)
        return torch.stack(outputs, dim=0).mean(dim=0)


# A batch of seed nodes with all their neighbours (graph-learn's "full" neighbour strategy): node 0 has 2 neighbours,
# node 1 has 5, node 2 has 1, node 3 has 3. Their features are flattened and `segment_ids` records the owner.
feat_dim, hidden = 8, 12
num_nbrs = [2, 5, 1, 3]
self_feats = torch.randn(len(num_nbrs), feat_dim)
neigh_feats = torch.randn(sum(num_nbrs), feat_dim) * 2.0
segment_ids = torch.repeat_interleave(torch.arange(len(num_nbrs)), torch.tensor(num_nbrs))

conv = MultiHeadGATConv(feat_dim, hidden, num_head=2).eval()
with torch.no_grad():
    emb = conv(self_feats, neigh_feats, segment_ids)

print("neighbours per node:", num_nbrs)
print("embedding norms:", [round(v, 5) for v in emb.norm(dim=-1).tolist()])
print("embedding[1][:4]:", [round(v, 5) for v in emb[1, :4].tolist()])
