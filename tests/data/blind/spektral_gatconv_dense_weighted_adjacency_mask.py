# danielegrattarola/spektral PR #299 (commits 9769d2e "modified dense attention mask to support non
# binary adjacency matrix" and 473ecd4 "cast mask", merged as 028cc95).
#
# spektral's GATConv, in batch mode (dense adjacency of shape (batch, n_nodes, n_nodes)), runs
# `_call_dense`: it sets the diagonal of `a` to 1 (self loops), scores every node pair, and before the
# softmax adds a mask built straight from the adjacency values, `mask = -10e9 * (1.0 - a)`.  That is
# right only when `a` holds 0 / 1.  With a weighted adjacency (here: a road-sensor graph whose edges
# carry a Gaussian distance kernel in (0, 1], one of them counted twice so its weight is above 1) an
# edge of weight 0.5 gets -5e9 added and drops out of the softmax like a missing edge, while the edge
# of weight 1.47 gets +4.7e9 and takes all of the attention.  The fix builds the mask from where the adjacency is zero,
# `mask = tf.where(a == 0.0, -10e9, 0.0)` (cast to the scores' dtype), so every existing edge is
# attended whatever its weight.
#
# Ported from spektral/layers/convolutional/gat_conv.py (GATConv.__init__ / build / call /
# _call_dense) at 9769d2e^ and 473ecd4, Keras/TensorFlow rewritten in torch with the same names, kernel
# shapes and einsum strings; the model is a two-layer GAT node regressor in batch mode as in
# spektral's batch-mode examples, on a toy traffic-sensor batch.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


def glorot_uniform(shape):
    # Keras glorot_uniform: fan_in / fan_out from the last two dims, receptive field the rest
    receptive = 1
    for s in shape[:-2]:
        receptive *= s
    fan_in, fan_out = shape[-2] * receptive, shape[-1] * receptive
    limit = (6.0 / (fan_in + fan_out)) ** 0.5
    return nn.Parameter(torch.empty(*shape).uniform_(-limit, limit))


class GATConv(nn.Module):
    def __init__(
        self,
        input_dim,
        channels,
        attn_heads=1,
        concat_heads=True,
        dropout_rate=0.5,
        return_attn_coef=False,
        add_self_loops=True,
        activation=None,
        use_bias=True,
    ):
        super().__init__()
        self.channels = channels
        self.attn_heads = attn_heads
        self.concat_heads = concat_heads
        self.dropout_rate = dropout_rate
        self.return_attn_coef = return_attn_coef
        self.add_self_loops = add_self_loops
        self.activation = activation or (lambda t: t)
        self.use_bias = use_bias

        if concat_heads:
            self.output_dim = self.channels * self.attn_heads
        else:
            self.output_dim = self.channels

        # build()
        self.kernel = glorot_uniform([input_dim, self.attn_heads, self.channels])
        self.attn_kernel_self = glorot_uniform([self.channels, self.attn_heads, 1])
        self.attn_kernel_neighs = glorot_uniform([self.channels, self.attn_heads, 1])
        if self.use_bias:
            self.bias = nn.Parameter(torch.zeros(self.output_dim))
        self.dropout = nn.Dropout(self.dropout_rate)

    def forward(self, inputs, mask=None):
        x, a = inputs

        output, attn_coef = self._call_dense(x, a)

        if self.concat_heads:
            shape = output.shape[:-2] + (self.attn_heads * self.channels,)
            output = output.reshape(shape)
        else:
            output = output.mean(dim=-2)

        if self.use_bias:
            output = output + self.bias
        if mask is not None:
            output = output * mask[0]
        output = self.activation(output)

        if self.return_attn_coef:
            return output, attn_coef
        else:
            return output

    def _call_dense(self, x, a):
        shape = a.shape[:-1]
        if self.add_self_loops:
            # tf.linalg.set_diag(a, tf.ones(shape, a.dtype))
            a = torch.diagonal_scatter(a, torch.ones(shape, dtype=a.dtype), dim1=-2, dim2=-1)
        x = torch.einsum("...NI , IHO -> ...NHO", x, self.kernel)
        attn_for_self = torch.einsum("...NHI , IHO -> ...NHO", x, self.attn_kernel_self)
        attn_for_neighs = torch.einsum("...NHI , IHO -> ...NHO", x, self.attn_kernel_neighs)
        attn_for_neighs = torch.einsum("...ABC -> ...CBA", attn_for_neighs)

        attn_coef = attn_for_self + attn_for_neighs
        attn_coef = F.leaky_relu(attn_coef, negative_slope=0.2)

        if FIXED:
            mask = torch.where(a == 0.0, -10e9, 0.0)
            mask = mask.to(dtype=attn_coef.dtype)
        else:
            mask = -10e9 * (1.0 - a)
        attn_coef = attn_coef + mask[..., None, :]
        attn_coef = torch.softmax(attn_coef, dim=-1)
        attn_coef_drop = self.dropout(attn_coef)

        output = torch.einsum("...NHM , ...MHI -> ...NHI", attn_coef_drop, x)

        return output, attn_coef


class Net(nn.Module):
    """Batch-mode GAT: two GATConv layers, then a per-node dense head (next-step speed)."""

    def __init__(self, n_node_features, channels=8, heads=4):
        super().__init__()
        self.conv1 = GATConv(n_node_features, channels, attn_heads=heads, concat_heads=True,
                             dropout_rate=0.0, activation=F.elu)
        self.conv2 = GATConv(channels * heads, channels, attn_heads=1, concat_heads=False,
                             dropout_rate=0.0, activation=F.elu)
        self.dense = nn.Linear(channels, 1)

    def forward(self, inputs):
        x, a = inputs
        x = self.conv1([x, a])
        x = self.conv2([x, a])
        return self.dense(x).squeeze(-1)


def sensor_adjacency(coords, sigma=0.7, threshold=0.2):
    # Gaussian kernel on road distance, as in the METR-LA / PEMS-BAY adjacency: w_ij = exp(-d^2 / s^2)
    d = torch.cdist(coords, coords)
    w = torch.exp(-(d ** 2) / sigma ** 2)
    w[w < threshold] = 0.0
    w.fill_diagonal_(0.0)
    return w


# Two small sensor networks (5 and 4 sensors), zero-padded to 5 nodes for batch mode.
n_max, n_feat = 5, 4
coords_0 = torch.tensor([[0.0, 0.0], [0.6, 0.1], [1.1, 0.4], [0.3, 0.9], [1.4, 1.2]])
coords_1 = torch.tensor([[0.0, 0.0], [0.5, 0.5], [1.0, 0.2], [0.2, 1.1]])

a = torch.zeros(2, n_max, n_max)
a[0] = sensor_adjacency(coords_0)
a[1, :4, :4] = sensor_adjacency(coords_1)
# sensors 0 and 1 of the first network sit on two parallel carriageways: the edge is counted twice
a[0, 0, 1] += 1.0
a[0, 1, 0] += 1.0

# last four 5-minute speed readings per sensor, normalised; padded node is zero
x = torch.randn(2, n_max, n_feat)
x[1, 4] = 0.0

model = Net(n_feat)
model.eval()
with torch.no_grad():
    pred = model([x, a])
    att = model.conv2._call_dense(model.conv1([x, a]), a)[1]

print("adjacency (graph 0):")
print(a[0])
print("layer-2 attention of sensor 2 (graph 0):", att[0, 2, 0].numpy().round(4))
print("next-step speed prediction (graph 0):", pred[0].numpy().round(4))
print("next-step speed prediction (graph 1):", pred[1, :4].numpy().round(4))
