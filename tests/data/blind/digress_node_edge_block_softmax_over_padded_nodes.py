# cvignac/DiGress commit 57df5f8 ("Replaced softmax by a masked version."), src/models/transformer_model.py
# and src/models/layers.py.
#
# DiGress denoises a batch of molecular graphs of different sizes, densified the PyG way
# (`utils.to_dense`: to_dense_batch gives X (bs, n, dx) and node_mask (bs, n), to_dense_adj gives
# E (bs, n, n, de)).  Its GraphTransformer's NodeEdgeBlock builds feature-wise attention scores
# Y = Q * K (bs, n, n, n_head, df), modulates them by the edge features (FiLM), and takes a softmax over
# the key nodes (dim=2).  Q, K and the FiLM terms are multiplied by the node mask, so a padded key's
# score is exactly 0, not removed: before the fix `attn = F.softmax(Y, dim=2)` gave every padded key
# exp(0) of each real node's attention mass, and since V is zero there, each real node's update was
# shrunk by an amount that depends on how much padding its graph got in the batch.  The fix builds
# `softmax_mask = e_mask2.expand(-1, n, -1, n_head)` and calls `masked_softmax(Y, softmax_mask, dim=2)`,
# which sets the scores of masked keys to -inf first.
#
# Ported from src/models/transformer_model.py (XEyTransformerLayer, NodeEdgeBlock, GraphTransformer),
# src/models/layers.py (Xtoy, Etoy, masked_softmax), src/utils.py (PlaceHolder, to_dense, encode_no_edge),
# src/diffusion/diffusion_utils.py (assert_correctly_masked), src/metrics/train_metrics.py
# (TrainLossDiscrete) and the forward of src/diffusion_model_discrete.py at 57df5f8^ / 57df5f8.
# to_dense_batch / to_dense_adj are written out by hand (no torch_geometric); the diffusion noise is
# left out (the clean graph is fed in at a fixed t).  The same commit's change to mask_distributions
# (a loss helper) is not a mask-of-attention change and is left out of both runs.
import math
import sys
import warnings

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.modules.dropout import Dropout
from torch.nn.modules.linear import Linear
from torch.nn.modules.normalization import LayerNorm
from torch import Tensor

FIXED = "--fixed" in sys.argv
warnings.filterwarnings("ignore", message="Initializing zero-element tensors")  # output_dims['y'] = 0

torch.manual_seed(0)


# ---- src/diffusion/diffusion_utils.py ----------------------------------------------------------

def assert_correctly_masked(variable, node_mask):
    assert (variable * (1 - node_mask.long())).abs().max().item() < 1e-4, \
        'Variables not masked properly.'


# ---- src/utils.py ------------------------------------------------------------------------------

class PlaceHolder:
    def __init__(self, X, E, y):
        self.X = X
        self.E = E
        self.y = y

    def mask(self, node_mask, collapse=False):
        x_mask = node_mask.unsqueeze(-1)          # bs, n, 1
        e_mask1 = x_mask.unsqueeze(2)             # bs, n, 1, 1
        e_mask2 = x_mask.unsqueeze(1)             # bs, 1, n, 1

        if collapse:
            self.X = torch.argmax(self.X, dim=-1)
            self.E = torch.argmax(self.E, dim=-1)

            self.X[node_mask == 0] = - 1
            self.E[(e_mask1 * e_mask2).squeeze(-1) == 0] = - 1
        else:
            self.X = self.X * x_mask
            self.E = self.E * e_mask1 * e_mask2
            assert torch.allclose(self.E, torch.transpose(self.E, 1, 2))
        return self


def to_dense_batch(x, batch):
    """torch_geometric.utils.to_dense_batch (fill_value 0, right padding)."""
    bs = int(batch.max()) + 1
    counts = torch.bincount(batch, minlength=bs)
    n = int(counts.max())
    ptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    pos = torch.arange(batch.numel()) - ptr[batch]
    out = x.new_zeros(bs, n, x.size(-1))
    out[batch, pos] = x
    mask = torch.zeros(bs, n, dtype=torch.bool)
    mask[batch, pos] = True
    return out, mask


def to_dense_adj(edge_index, batch, edge_attr, max_num_nodes):
    """torch_geometric.utils.to_dense_adj with edge features."""
    bs = int(batch.max()) + 1
    counts = torch.bincount(batch, minlength=bs)
    ptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    src, dst = edge_index
    b = batch[src]
    out = edge_attr.new_zeros(bs, max_num_nodes, max_num_nodes, edge_attr.size(-1))
    out[b, src - ptr[b], dst - ptr[b]] += edge_attr
    return out


def to_dense(x, edge_index, edge_attr, batch):
    X, node_mask = to_dense_batch(x=x, batch=batch)
    keep = edge_index[0] != edge_index[1]                      # remove_self_loops
    edge_index, edge_attr = edge_index[:, keep], edge_attr[keep]
    max_num_nodes = X.size(1)
    E = to_dense_adj(edge_index=edge_index, batch=batch, edge_attr=edge_attr, max_num_nodes=max_num_nodes)
    E = encode_no_edge(E)

    return PlaceHolder(X=X, E=E, y=None), node_mask


def encode_no_edge(E):
    assert len(E.shape) == 4
    if E.shape[-1] == 0:
        return E
    no_edge = torch.sum(E, dim=3) == 0
    first_elt = E[:, :, :, 0]
    first_elt[no_edge] = 1
    E[:, :, :, 0] = first_elt
    diag = torch.eye(E.shape[1], dtype=torch.bool).unsqueeze(0).expand(E.shape[0], -1, -1)
    E[diag] = 0
    return E


# ---- src/models/layers.py ----------------------------------------------------------------------

class Xtoy(nn.Module):
    def __init__(self, dx, dy):
        """ Map node features to global features """
        super().__init__()
        self.lin = nn.Linear(4 * dx, dy)

    def forward(self, X):
        """ X: bs, n, dx. """
        m = X.mean(dim=1)
        mi = X.min(dim=1)[0]
        ma = X.max(dim=1)[0]
        std = X.std(dim=1)
        z = torch.hstack((m, mi, ma, std))
        out = self.lin(z)
        return out


class Etoy(nn.Module):
    def __init__(self, d, dy):
        """ Map edge features to global features. """
        super().__init__()
        self.lin = nn.Linear(4 * d, dy)

    def forward(self, E):
        """ E: bs, n, n, de
            Features relative to the diagonal of E could potentially be added.
        """
        m = E.mean(dim=(1, 2))
        mi = E.min(dim=2)[0].min(dim=1)[0]
        ma = E.max(dim=2)[0].max(dim=1)[0]
        std = torch.std(E, dim=(1, 2))
        z = torch.hstack((m, mi, ma, std))
        out = self.lin(z)
        return out


def masked_softmax(x, mask, **kwargs):
    x_masked = x.clone()
    x_masked[mask == 0] = -float("inf")
    return torch.softmax(x_masked, **kwargs)


# ---- src/models/transformer_model.py -----------------------------------------------------------

class XEyTransformerLayer(nn.Module):
    """ Transformer that updates node, edge and global features """
    def __init__(self, dx: int, de: int, dy: int, n_head: int, dim_ffX: int = 2048,
                 dim_ffE: int = 128, dim_ffy: int = 2048, dropout: float = 0.1,
                 layer_norm_eps: float = 1e-5, device=None, dtype=None) -> None:
        kw = {'device': device, 'dtype': dtype}
        super().__init__()

        self.self_attn = NodeEdgeBlock(dx, de, dy, n_head, **kw)

        self.linX1 = Linear(dx, dim_ffX, **kw)
        self.linX2 = Linear(dim_ffX, dx, **kw)
        self.normX1 = LayerNorm(dx, eps=layer_norm_eps, **kw)
        self.normX2 = LayerNorm(dx, eps=layer_norm_eps, **kw)
        self.dropoutX1 = Dropout(dropout)
        self.dropoutX2 = Dropout(dropout)
        self.dropoutX3 = Dropout(dropout)

        self.linE1 = Linear(de, dim_ffE, **kw)
        self.linE2 = Linear(dim_ffE, de, **kw)
        self.normE1 = LayerNorm(de, eps=layer_norm_eps, **kw)
        self.normE2 = LayerNorm(de, eps=layer_norm_eps, **kw)
        self.dropoutE1 = Dropout(dropout)
        self.dropoutE2 = Dropout(dropout)
        self.dropoutE3 = Dropout(dropout)

        self.lin_y1 = Linear(dy, dim_ffy, **kw)
        self.lin_y2 = Linear(dim_ffy, dy, **kw)
        self.norm_y1 = LayerNorm(dy, eps=layer_norm_eps, **kw)
        self.norm_y2 = LayerNorm(dy, eps=layer_norm_eps, **kw)
        self.dropout_y1 = Dropout(dropout)
        self.dropout_y2 = Dropout(dropout)
        self.dropout_y3 = Dropout(dropout)

        self.activation = F.relu

    def forward(self, X: Tensor, E: Tensor, y, node_mask: Tensor):
        newX, newE, new_y = self.self_attn(X, E, y, node_mask=node_mask)

        newX_d = self.dropoutX1(newX)
        X = self.normX1(X + newX_d)

        newE_d = self.dropoutE1(newE)
        E = self.normE1(E + newE_d)

        new_y_d = self.dropout_y1(new_y)
        y = self.norm_y1(y + new_y_d)

        ff_outputX = self.linX2(self.dropoutX2(self.activation(self.linX1(X))))
        ff_outputX = self.dropoutX3(ff_outputX)
        X = self.normX2(X + ff_outputX)

        ff_outputE = self.linE2(self.dropoutE2(self.activation(self.linE1(E))))
        ff_outputE = self.dropoutE3(ff_outputE)
        E = self.normE2(E + ff_outputE)

        ff_output_y = self.lin_y2(self.dropout_y2(self.activation(self.lin_y1(y))))
        ff_output_y = self.dropout_y3(ff_output_y)
        y = self.norm_y2(y + ff_output_y)

        return X, E, y


class NodeEdgeBlock(nn.Module):
    """ Self attention layer that also updates the representations on the edges. """
    def __init__(self, dx, de, dy, n_head, **kwargs):
        super().__init__()
        assert dx % n_head == 0, f"dx: {dx} -- nhead: {n_head}"
        self.dx = dx
        self.de = de
        self.dy = dy
        self.df = int(dx / n_head)
        self.n_head = n_head

        # Attention
        self.q = Linear(dx, dx)
        self.k = Linear(dx, dx)
        self.v = Linear(dx, dx)

        # FiLM E to X
        self.e_add = Linear(de, dx)
        self.e_mul = Linear(de, dx)

        # FiLM y to E
        self.y_e_mul = Linear(dy, dx)           # Warning: here it's dx and not de
        self.y_e_add = Linear(dy, dx)

        # FiLM y to X
        self.y_x_mul = Linear(dy, dx)
        self.y_x_add = Linear(dy, dx)

        # Process y
        self.y_y = Linear(dy, dy)
        self.x_y = Xtoy(dx, dy)
        self.e_y = Etoy(de, dy)

        # Output layers
        self.x_out = Linear(dx, dx)
        self.e_out = Linear(dx, de)
        self.y_out = nn.Sequential(nn.Linear(dy, dy), nn.ReLU(), nn.Linear(dy, dy))

    def forward(self, X, E, y, node_mask):
        """
        :param X: bs, n, d        node features
        :param E: bs, n, n, d     edge features
        :param y: bs, dz           global features
        :param node_mask: bs, n
        :return: newX, newE, new_y with the same shape.
        """
        bs, n, _ = X.shape
        x_mask = node_mask.unsqueeze(-1)        # bs, n, 1
        e_mask1 = x_mask.unsqueeze(2)           # bs, n, 1, 1
        e_mask2 = x_mask.unsqueeze(1)           # bs, 1, n, 1

        # 1. Map X to keys and queries
        Q = self.q(X) * x_mask           # (bs, n, dx)
        K = self.k(X) * x_mask           # (bs, n, dx)
        assert_correctly_masked(Q, x_mask)
        # 2. Reshape to (bs, n, n_head, df) with dx = n_head * df

        Q = Q.reshape((Q.size(0), Q.size(1), self.n_head, self.df))
        K = K.reshape((K.size(0), K.size(1), self.n_head, self.df))

        Q = Q.unsqueeze(2)                              # (bs, 1, n, n_head, df)
        K = K.unsqueeze(1)                              # (bs, n, 1, n head, df)

        # Compute unnormalized attentions. Y is (bs, n, n, n_head, df)
        Y = Q * K
        Y = Y / math.sqrt(Y.size(-1))
        assert_correctly_masked(Y, (e_mask1 * e_mask2).unsqueeze(-1))

        E1 = self.e_mul(E) * e_mask1 * e_mask2                        # bs, n, n, dx
        E1 = E1.reshape((E.size(0), E.size(1), E.size(2), self.n_head, self.df))

        E2 = self.e_add(E) * e_mask1 * e_mask2                        # bs, n, n, dx
        E2 = E2.reshape((E.size(0), E.size(1), E.size(2), self.n_head, self.df))

        # Incorporate edge features to the self attention scores.
        Y = Y * (E1 + 1) + E2                  # (bs, n, n, n_head, df)

        # Incorporate y to E
        newE = Y.flatten(start_dim=3)                      # bs, n, n, dx
        ye1 = self.y_e_add(y).unsqueeze(1).unsqueeze(1)  # bs, 1, 1, de
        ye2 = self.y_e_mul(y).unsqueeze(1).unsqueeze(1)
        newE = ye1 + (ye2 + 1) * newE

        # Output E
        newE = self.e_out(newE) * e_mask1 * e_mask2      # bs, n, n, de
        assert_correctly_masked(newE, e_mask1 * e_mask2)

        # Compute attentions. attn is still (bs, n, n, n_head, df)
        if FIXED:
            softmax_mask = e_mask2.expand(-1, n, -1, self.n_head)    # bs, 1, n, 1
            attn = masked_softmax(Y, softmax_mask, dim=2)  # bs, n, n, n_head
        else:
            attn = F.softmax(Y, dim=2)

        V = self.v(X) * x_mask                        # bs, n, dx
        V = V.reshape((V.size(0), V.size(1), self.n_head, self.df))
        V = V.unsqueeze(1)                                     # (bs, 1, n, n_head, df)

        # Compute weighted values
        weighted_V = attn * V
        weighted_V = weighted_V.sum(dim=2)

        # Send output to input dim
        weighted_V = weighted_V.flatten(start_dim=2)            # bs, n, dx

        # Incorporate y to X
        yx1 = self.y_x_add(y).unsqueeze(1)
        yx2 = self.y_x_mul(y).unsqueeze(1)
        newX = yx1 + (yx2 + 1) * weighted_V

        # Output X
        newX = self.x_out(newX) * x_mask
        assert_correctly_masked(newX, x_mask)

        # Process y based on X axnd E
        y = self.y_y(y)
        e_y = self.e_y(E)
        x_y = self.x_y(X)
        new_y = y + x_y + e_y
        new_y = self.y_out(new_y)               # bs, dy

        return newX, newE, new_y


class GraphTransformer(nn.Module):
    """
    n_layers : int -- number of layers
    dims : dict -- contains dimensions for each feature type
    """
    def __init__(self, n_layers: int, input_dims: dict, hidden_mlp_dims: dict, hidden_dims: dict,
                 output_dims: dict, act_fn_in: nn.ReLU(), act_fn_out: nn.ReLU()):
        super().__init__()
        self.n_layers = n_layers
        self.out_dim_X = output_dims['X']
        self.out_dim_E = output_dims['E']
        self.out_dim_y = output_dims['y']

        self.mlp_in_X = nn.Sequential(nn.Linear(input_dims['X'], hidden_mlp_dims['X']), act_fn_in,
                                      nn.Linear(hidden_mlp_dims['X'], hidden_dims['dx']), act_fn_in)

        self.mlp_in_E = nn.Sequential(nn.Linear(input_dims['E'], hidden_mlp_dims['E']), act_fn_in,
                                      nn.Linear(hidden_mlp_dims['E'], hidden_dims['de']), act_fn_in)

        self.mlp_in_y = nn.Sequential(nn.Linear(input_dims['y'], hidden_mlp_dims['y']), act_fn_in,
                                      nn.Linear(hidden_mlp_dims['y'], hidden_dims['dy']), act_fn_in)

        self.tf_layers = nn.ModuleList([XEyTransformerLayer(dx=hidden_dims['dx'],
                                                            de=hidden_dims['de'],
                                                            dy=hidden_dims['dy'],
                                                            n_head=hidden_dims['n_head'],
                                                            dim_ffX=hidden_dims['dim_ffX'],
                                                            dim_ffE=hidden_dims['dim_ffE'])
                                        for i in range(n_layers)])

        self.mlp_out_X = nn.Sequential(nn.Linear(hidden_dims['dx'], hidden_mlp_dims['X']), act_fn_out,
                                       nn.Linear(hidden_mlp_dims['X'], output_dims['X']))

        self.mlp_out_E = nn.Sequential(nn.Linear(hidden_dims['de'], hidden_mlp_dims['E']), act_fn_out,
                                       nn.Linear(hidden_mlp_dims['E'], output_dims['E']))

        self.mlp_out_y = nn.Sequential(nn.Linear(hidden_dims['dy'], hidden_mlp_dims['y']), act_fn_out,
                                       nn.Linear(hidden_mlp_dims['y'], output_dims['y']))

    def forward(self, X, E, y, node_mask):
        bs, n = X.shape[0], X.shape[1]

        diag_mask = torch.eye(n)
        diag_mask = ~diag_mask.type_as(E).bool()
        diag_mask = diag_mask.unsqueeze(0).unsqueeze(-1).expand(bs, -1, -1, -1)

        X_to_out = X[..., :self.out_dim_X]
        E_to_out = E[..., :self.out_dim_E]
        y_to_out = y[..., :self.out_dim_y]

        new_E = self.mlp_in_E(E)
        new_E = (new_E + new_E.transpose(1, 2)) / 2
        after_in = PlaceHolder(X=self.mlp_in_X(X), E=new_E, y=self.mlp_in_y(y)).mask(node_mask)
        X, E, y = after_in.X, after_in.E, after_in.y

        for layer in self.tf_layers:
            X, E, y = layer(X, E, y, node_mask)

        X = self.mlp_out_X(X)
        E = self.mlp_out_E(E)
        y = self.mlp_out_y(y)

        X = (X + X_to_out)
        E = (E + E_to_out) * diag_mask
        y = y + y_to_out

        E = 1/2 * (E + torch.transpose(E, 1, 2))

        return PlaceHolder(X=X, E=E, y=y).mask(node_mask)


# ---- src/metrics/train_metrics.py (TrainLossDiscrete, CrossEntropyMetric summed over the batch) ----

def cross_entropy_metric(preds, target):
    target = torch.argmax(target, dim=-1)
    return F.cross_entropy(preds, target, reduction='sum') / preds.size(0)


def train_loss_discrete(masked_pred_X, masked_pred_E, true_X, true_E, lambda_train):
    true_X = torch.reshape(true_X, (-1, true_X.size(-1)))  # (bs * n, dx)
    true_E = torch.reshape(true_E, (-1, true_E.size(-1)))  # (bs * n * n, de)
    masked_pred_X = torch.reshape(masked_pred_X, (-1, masked_pred_X.size(-1)))  # (bs * n, dx)
    masked_pred_E = torch.reshape(masked_pred_E, (-1, masked_pred_E.size(-1)))   # (bs * n * n, de)

    # Remove masked rows
    mask_X = (true_X != 0.).any(dim=-1)
    mask_E = (true_E != 0.).any(dim=-1)

    loss_X = cross_entropy_metric(masked_pred_X[mask_X, :], true_X[mask_X, :])
    loss_E = cross_entropy_metric(masked_pred_E[mask_E, :], true_E[mask_E, :])
    return loss_X + lambda_train[0] * loss_E


# ---- a QM9-style PyG batch (heavy atoms C, N, O, F; bonds none/single/double/triple/aromatic) -----

ATOMS = {'C': 0, 'N': 1, 'O': 2, 'F': 3}


def molecule(atoms, bonds):
    x = F.one_hot(torch.tensor([ATOMS[a] for a in atoms]), 4).float()
    ei, ea = [], []
    for s, t, order in bonds:
        ei += [(s, t), (t, s)]
        ea += [order, order]
    edge_index = torch.tensor(ei).t()
    edge_attr = F.one_hot(torch.tensor(ea), 5).float()
    return x, edge_index, edge_attr


mols = [
    molecule(['C', 'C', 'O'], [(0, 1, 1), (1, 2, 1)]),                                  # ethanol
    molecule(['C', 'C', 'C', 'N', 'C', 'O', 'F'],
             [(0, 1, 1), (1, 2, 2), (2, 3, 1), (3, 4, 1), (4, 5, 2), (0, 6, 1)]),
    molecule(['C', 'N'], [(0, 1, 3)]),                                                  # HCN
]
xs, eis, eas, batch = [], [], [], []
offset = 0
for i, (x, ei, ea) in enumerate(mols):
    xs.append(x)
    eis.append(ei + offset)
    eas.append(ea)
    batch.append(torch.full((x.size(0),), i, dtype=torch.long))
    offset += x.size(0)
data_x, data_edge_index, data_edge_attr, data_batch = (torch.cat(xs), torch.cat(eis, dim=1),
                                                       torch.cat(eas), torch.cat(batch))

# ---- DiscreteDenoisingDiffusion.training_step / forward, without the noise ----------------------

model = GraphTransformer(n_layers=2,
                         input_dims={'X': 4, 'E': 5, 'y': 1},
                         hidden_mlp_dims={'X': 32, 'E': 16, 'y': 16},
                         hidden_dims={'dx': 32, 'de': 8, 'dy': 16, 'n_head': 4, 'dim_ffX': 64, 'dim_ffE': 16},
                         output_dims={'X': 4, 'E': 5, 'y': 0},
                         act_fn_in=nn.ReLU(), act_fn_out=nn.ReLU())
model.eval()

dense_data, node_mask = to_dense(data_x, data_edge_index, data_edge_attr, data_batch)
dense_data = dense_data.mask(node_mask)
X, E = dense_data.X, dense_data.E
t = torch.full((X.size(0), 1), 0.5)                    # noisy_data['t']; extra_data.y = t

with torch.no_grad():
    pred = model(X.float(), E.float(), t, node_mask)
    loss = train_loss_discrete(pred.X, pred.E, X, E, lambda_train=[5, 0])

print("node_mask:", node_mask.int().tolist())
print("train loss (CE):", round(loss.item(), 5))
probs = torch.softmax(pred.X[2, :2], dim=-1)
print("HCN atom-type probabilities:", [[round(v, 4) for v in row] for row in probs.tolist()])
