# danielegrattarola/spektral#302, fixed in commit 570cb91 ("Fix bug in GlobalAttnSumPool that caused the readout to apply attention
# to the full disjoint batch (see issue #302)"), spektral/layers/pooling/global_pool.py, ported from Keras to torch.
#
# GlobalAttnSumPool reads a graph out as an attention-weighted sum of its node features. In disjoint mode (the graphs
# of a mini-batch concatenated node after node, `I` giving each node's graph id, as spektral's DisjointLoader does) it
# ran one `K.softmax` over the scores of every node in the batch and then `segment_sum`med per graph, so each
# molecule's attention weights were normalised against the atoms of all the other molecules in the batch. The fix
# keeps the plain softmax for single / batch mode and, in disjoint mode, uses
# `ops.unsorted_segment_softmax(attn_coeff, I, K.shape(X)[0])`, a softmax within each graph.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# spektral/layers/ops/scatter.py
def unsorted_segment_max(x, indices, n_nodes):
    out = torch.full((n_nodes,), float("-inf"), dtype=x.dtype)
    return out.scatter_reduce(0, indices, x, reduce="amax", include_self=True)


def unsorted_segment_sum(x, indices, n_nodes):
    return torch.zeros((n_nodes,) + x.shape[1:], dtype=x.dtype).index_add_(0, indices, x)


def unsorted_segment_softmax(x, indices, n_nodes=None):
    """Softmax along the segments of x (first dimension); same shape as the input."""
    n_nodes = int(indices.max()) + 1 if n_nodes is None else n_nodes
    e_x = torch.exp(x - unsorted_segment_max(x, indices, n_nodes)[indices])
    e_x = e_x / (unsorted_segment_sum(e_x, indices, n_nodes) + 1e-9)[indices]
    return e_x


def segment_sum(x, segment_ids):
    n = int(segment_ids.max()) + 1
    return unsorted_segment_sum(x, segment_ids, n)


class GlobalAttnSumPool(nn.Module):
    """
    A node-attention global pooling layer. Pools a graph by learning attention coefficients to sum node features.

    **Mode**: single, disjoint, batch.

    **Input**
    - Node features of shape `([batch], n_nodes, n_node_features)`;
    - Graph IDs of shape `(n_nodes, )` (only in disjoint mode);

    **Output**
    - Pooled node features of shape `(batch, n_node_features)`.
    """

    def __init__(self, n_node_features):
        super().__init__()
        self.attn_kernel = nn.Parameter(torch.empty(n_node_features, 1))
        nn.init.xavier_uniform_(self.attn_kernel)  # attn_kernel_initializer="glorot_uniform"
        self.data_mode = None

    def build(self, inputs):
        if isinstance(inputs, (list, tuple)) and len(inputs) == 2:
            self.data_mode = "disjoint"
        elif inputs.dim() == 2:
            self.data_mode = "single"
        else:
            self.data_mode = "batch"

    def forward(self, inputs):
        if self.data_mode is None:
            self.build(inputs)
        if self.data_mode == "disjoint":
            X, I = inputs
            if I.dim() == 2:
                I = I[:, 0]
        else:
            X = inputs
        attn_coeff = X @ self.attn_kernel
        attn_coeff = attn_coeff.squeeze(-1)
        if not FIXED:
            attn_coeff = torch.softmax(attn_coeff, dim=-1)
        if self.data_mode == "single":
            if FIXED:
                attn_coeff = torch.softmax(attn_coeff, dim=-1)
            output = attn_coeff[None, ...] @ X
        elif self.data_mode == "batch":
            if FIXED:
                attn_coeff = torch.softmax(attn_coeff, dim=-1)
            output = torch.einsum("bn,bnf->bf", attn_coeff, X)
        else:
            if FIXED:
                attn_coeff = unsorted_segment_softmax(attn_coeff, I, X.shape[0])
            output = attn_coeff[:, None] * X
            output = segment_sum(output, I)
        return output


class Net(nn.Module):
    """A molecular property regressor in the style of spektral's examples: node MLP, attention readout, head."""

    def __init__(self, n_atom_features, channels=16):
        super().__init__()
        self.dense1 = nn.Linear(n_atom_features, channels)
        self.pool = GlobalAttnSumPool(channels)
        self.dense2 = nn.Linear(channels, 1)

    def forward(self, inputs):
        x, i = inputs
        x = torch.relu(self.dense1(x))
        x = self.pool([x, i])
        return self.dense2(x)


def disjoint_batch(graphs):
    """What spektral's DisjointLoader yields: node features stacked, plus each node's graph index."""
    x = torch.cat(graphs, dim=0)
    i = torch.cat([torch.full((g.shape[0],), k, dtype=torch.long) for k, g in enumerate(graphs)])
    return x, i


n_atom_features = 9
molecules = [torch.randn(n, n_atom_features) for n in (5, 9, 3, 7)]
targets = torch.randn(len(molecules), 1)

model = Net(n_atom_features).eval()
x, i = disjoint_batch(molecules)
with torch.no_grad():
    preds = model([x, i])
    loss = torch.mean((preds - targets) ** 2)

print("graphs in batch:", len(molecules), "atoms:", x.shape[0])
print("predictions:", [round(v, 5) for v in preds.squeeze(-1).tolist()])
print("mse loss: %.6f" % loss.item())
