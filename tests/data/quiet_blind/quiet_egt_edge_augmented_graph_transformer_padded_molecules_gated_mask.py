# Correct program. Ported from shamim-hussain/egt_pytorch @9e66956a5fdc6f6e8a865863d029468380bb63e5:
# lib/models/egt_layers.py (Graph, EGT_Layer with its TorchScript _egt / _egt_edge), lib/models/egt.py (EGT_Base, EGT),
# lib/models/egt_molgraph.py (EGT_MOL: input_block builds g.mask = (nodem_i * nodem_j - 1) * 1e9, masked-mean
# readout when num_virtual_nodes = 0), lib/models/pcqm4mv2/model.py (EGT_PCQM4MV2), lib/data/graph_dataset/
# structural_dataset.py (preprocess_data, floyd_warshall), lib/data/graph_dataset/graph_dataset.py (node_mask,
# graphdata_collate) and stack_with_pad.py (zero padding to the batch's largest graph), pcqm4mv2 scheme (L1 loss).
# Numba kernels written as plain numpy; no SVD encodings; num_virtual_nodes = 0 (EGT_MOL's default).
import numpy as np
import torch
from torch import nn
import torch.nn.functional as F
from typing import Tuple, Optional
from collections import defaultdict


class Graph(dict):
    def __dir__(self):
        return super().__dir__() + list(self.keys())

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError('No such attribute: '+key)

    def __setattr__(self, key, value):
        self[key] = value

    def copy(self):
        return self.__class__(self)


class EGT_Layer(nn.Module):
    @staticmethod
    @torch.jit.script
    def _egt(scale_dot: bool,
             scale_degree: bool,
             num_heads: int,
             dot_dim: int,
             clip_logits_min: float,
             clip_logits_max: float,
             attn_dropout: float,
             attn_maskout: float,
             training: bool,
             num_vns: int,
             QKV: torch.Tensor,
             G: torch.Tensor,
             E: torch.Tensor,
             mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        shp = QKV.shape
        Q, K, V = QKV.view(shp[0],shp[1],-1,num_heads).split(dot_dim,dim=2)

        A_hat = torch.einsum('bldh,bmdh->blmh', Q, K)
        if scale_dot:
            A_hat = A_hat * (dot_dim ** -0.5)

        H_hat = A_hat.clamp(clip_logits_min, clip_logits_max) + E

        if mask is None:
            if attn_maskout > 0 and training:
                rmask = torch.empty_like(H_hat).bernoulli_(attn_maskout) * -1e9
                gates = torch.sigmoid(G)#+rmask
                A_tild = F.softmax(H_hat+rmask, dim=2) * gates
            else:
                gates = torch.sigmoid(G)
                A_tild = F.softmax(H_hat, dim=2) * gates
        else:
            if attn_maskout > 0 and training:
                rmask = torch.empty_like(H_hat).bernoulli_(attn_maskout) * -1e9
                gates = torch.sigmoid(G+mask)
                A_tild = F.softmax(H_hat+mask+rmask, dim=2) * gates
            else:
                gates = torch.sigmoid(G+mask)
                A_tild = F.softmax(H_hat+mask, dim=2) * gates

        if attn_dropout > 0:
            A_tild = F.dropout(A_tild, p=attn_dropout, training=training)

        V_att = torch.einsum('blmh,bmkh->blkh', A_tild, V)

        if scale_degree:
            degrees = torch.sum(gates,dim=2,keepdim=True)
            degree_scalers = torch.log(1+degrees)
            degree_scalers[:,:num_vns] = 1.
            V_att = V_att * degree_scalers

        V_att = V_att.reshape(shp[0],shp[1],num_heads*dot_dim)
        return V_att, H_hat

    @staticmethod
    @torch.jit.script
    def _egt_edge(scale_dot: bool,
                  num_heads: int,
                  dot_dim: int,
                  clip_logits_min: float,
                  clip_logits_max: float,
                  QK: torch.Tensor,
                  E: torch.Tensor) -> torch.Tensor:
        shp = QK.shape
        Q, K = QK.view(shp[0],shp[1],-1,num_heads).split(dot_dim,dim=2)

        A_hat = torch.einsum('bldh,bmdh->blmh', Q, K)
        if scale_dot:
            A_hat = A_hat * (dot_dim ** -0.5)
        H_hat = A_hat.clamp(clip_logits_min, clip_logits_max) + E
        return H_hat

    def __init__(self,
                 node_width                      ,
                 edge_width                      ,
                 num_heads                       ,
                 node_mha_dropout    = 0         ,
                 edge_mha_dropout    = 0         ,
                 node_ffn_dropout    = 0         ,
                 edge_ffn_dropout    = 0         ,
                 attn_dropout        = 0         ,
                 attn_maskout        = 0         ,
                 activation          = 'elu'     ,
                 clip_logits_value   = [-5,5]    ,
                 node_ffn_multiplier = 2.        ,
                 edge_ffn_multiplier = 2.        ,
                 scale_dot           = True      ,
                 scale_degree        = False     ,
                 node_update         = True      ,
                 edge_update         = True      ,
                 ):
        super().__init__()
        self.node_width          = node_width
        self.edge_width          = edge_width
        self.num_heads           = num_heads
        self.node_mha_dropout    = node_mha_dropout
        self.edge_mha_dropout    = edge_mha_dropout
        self.node_ffn_dropout    = node_ffn_dropout
        self.edge_ffn_dropout    = edge_ffn_dropout
        self.attn_dropout        = attn_dropout
        self.attn_maskout        = attn_maskout
        self.activation          = activation
        self.clip_logits_value   = clip_logits_value
        self.node_ffn_multiplier = node_ffn_multiplier
        self.edge_ffn_multiplier = edge_ffn_multiplier
        self.scale_dot           = scale_dot
        self.scale_degree        = scale_degree
        self.node_update         = node_update
        self.edge_update         = edge_update

        assert not (self.node_width % self.num_heads)
        self.dot_dim = self.node_width//self.num_heads

        self.mha_ln_h   = nn.LayerNorm(self.node_width)
        self.mha_ln_e   = nn.LayerNorm(self.edge_width)
        self.lin_E      = nn.Linear(self.edge_width, self.num_heads)
        if self.node_update:
            self.lin_QKV    = nn.Linear(self.node_width, self.node_width*3)
            self.lin_G      = nn.Linear(self.edge_width, self.num_heads)
        else:
            self.lin_QKV    = nn.Linear(self.node_width, self.node_width*2)

        self.ffn_fn     = getattr(F, self.activation)
        if self.node_update:
            self.lin_O_h    = nn.Linear(self.node_width, self.node_width)
            if self.node_mha_dropout > 0:
                self.mha_drp_h  = nn.Dropout(self.node_mha_dropout)

            node_inner_dim  = round(self.node_width*self.node_ffn_multiplier)
            self.ffn_ln_h   = nn.LayerNorm(self.node_width)
            self.lin_W_h_1  = nn.Linear(self.node_width, node_inner_dim)
            self.lin_W_h_2  = nn.Linear(node_inner_dim, self.node_width)
            if self.node_ffn_dropout > 0:
                self.ffn_drp_h  = nn.Dropout(self.node_ffn_dropout)

        if self.edge_update:
            self.lin_O_e    = nn.Linear(self.num_heads, self.edge_width)
            if self.edge_mha_dropout > 0:
                self.mha_drp_e  = nn.Dropout(self.edge_mha_dropout)

            edge_inner_dim  = round(self.edge_width*self.edge_ffn_multiplier)
            self.ffn_ln_e   = nn.LayerNorm(self.edge_width)
            self.lin_W_e_1  = nn.Linear(self.edge_width, edge_inner_dim)
            self.lin_W_e_2  = nn.Linear(edge_inner_dim, self.edge_width)
            if self.edge_ffn_dropout > 0:
                self.ffn_drp_e  = nn.Dropout(self.edge_ffn_dropout)

    def forward(self, g):
        h, e = g.h, g.e
        mask = g.mask

        h_r1 = h
        e_r1 = e

        h_ln = self.mha_ln_h(h)
        e_ln = self.mha_ln_e(e)

        QKV = self.lin_QKV(h_ln)
        E = self.lin_E(e_ln)

        if self.node_update:
            G = self.lin_G(e_ln)
            V_att, H_hat = self._egt(self.scale_dot,
                                     self.scale_degree,
                                     self.num_heads,
                                     self.dot_dim,
                                     self.clip_logits_value[0],
                                     self.clip_logits_value[1],
                                     self.attn_dropout,
                                     self.attn_maskout,
                                     self.training,
                                     0 if 'num_vns' not in g else g.num_vns,
                                     QKV,
                                     G, E, mask)

            h = self.lin_O_h(V_att)
            if self.node_mha_dropout > 0:
                h = self.mha_drp_h(h)
            h.add_(h_r1)

            h_r2 = h
            h_ln = self.ffn_ln_h(h)
            h = self.lin_W_h_2(self.ffn_fn(self.lin_W_h_1(h_ln)))
            if self.node_ffn_dropout > 0:
                h = self.ffn_drp_h(h)
            h.add_(h_r2)
        else:
            H_hat = self._egt_edge(self.scale_dot,
                                   self.num_heads,
                                   self.dot_dim,
                                   self.clip_logits_value[0],
                                   self.clip_logits_value[1],
                                   QKV, E)

        if self.edge_update:
            e = self.lin_O_e(H_hat)
            if self.edge_mha_dropout > 0:
                e = self.mha_drp_e(e)
            e.add_(e_r1)

            e_r2 = e
            e_ln = self.ffn_ln_e(e)
            e = self.lin_W_e_2(self.ffn_fn(self.lin_W_e_1(e_ln)))
            if self.edge_ffn_dropout > 0:
                e = self.ffn_drp_e(e)
            e.add_(e_r2)

        g = g.copy()
        g.h, g.e = h, e
        return g


class EGT_Base(nn.Module):
    def __init__(self,
                 node_width          = 128       ,
                 edge_width          = 32        ,
                 num_heads           = 8         ,
                 model_height        = 4         ,
                 node_mha_dropout    = 0.        ,
                 node_ffn_dropout    = 0.        ,
                 edge_mha_dropout    = 0.        ,
                 edge_ffn_dropout    = 0.        ,
                 attn_dropout        = 0.        ,
                 attn_maskout        = 0.        ,
                 activation          = 'elu'     ,
                 clip_logits_value   = [-5,5]    ,
                 node_ffn_multiplier = 2.        ,
                 edge_ffn_multiplier = 2.        ,
                 scale_dot           = True      ,
                 scale_degree        = False     ,
                 node_ended          = False     ,
                 edge_ended          = False     ,
                 egt_simple          = False     ,
                 **kwargs
                 ):
        super().__init__(**kwargs)

        self.node_width          = node_width
        self.edge_width          = edge_width
        self.num_heads           = num_heads
        self.model_height        = model_height
        self.node_mha_dropout    = node_mha_dropout
        self.node_ffn_dropout    = node_ffn_dropout
        self.edge_mha_dropout    = edge_mha_dropout
        self.edge_ffn_dropout    = edge_ffn_dropout
        self.attn_dropout        = attn_dropout
        self.attn_maskout        = attn_maskout
        self.activation          = activation
        self.clip_logits_value   = clip_logits_value
        self.node_ffn_multiplier = node_ffn_multiplier
        self.edge_ffn_multiplier = edge_ffn_multiplier
        self.scale_dot           = scale_dot
        self.scale_degree        = scale_degree
        self.node_ended          = node_ended
        self.edge_ended          = edge_ended
        self.egt_simple          = egt_simple

        self.layer_common_kwargs = dict(
             node_width          = self.node_width            ,
             edge_width          = self.edge_width            ,
             num_heads           = self.num_heads             ,
             node_mha_dropout    = self.node_mha_dropout      ,
             node_ffn_dropout    = self.node_ffn_dropout      ,
             edge_mha_dropout    = self.edge_mha_dropout      ,
             edge_ffn_dropout    = self.edge_ffn_dropout      ,
             attn_dropout        = self.attn_dropout          ,
             attn_maskout        = self.attn_maskout          ,
             activation          = self.activation            ,
             clip_logits_value   = self.clip_logits_value     ,
             scale_dot           = self.scale_dot             ,
             scale_degree        = self.scale_degree          ,
             node_ffn_multiplier = self.node_ffn_multiplier   ,
             edge_ffn_multiplier = self.edge_ffn_multiplier   ,
        )

    def input_block(self, inputs):
        return Graph(inputs)

    def final_embedding(self, g):
        raise NotImplementedError

    def output_block(self, g):
        raise NotImplementedError

    def forward(self, inputs):
        raise NotImplementedError


class EGT(EGT_Base):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)

        self.EGT_layers = nn.ModuleList([EGT_Layer(**self.layer_common_kwargs,
                                                   edge_update=(not self.egt_simple))
                                         for _ in range(self.model_height-1)])

        if (not self.node_ended) and (not self.edge_ended):
            pass
        elif not self.node_ended:
            self.EGT_layers.append(EGT_Layer(**self.layer_common_kwargs, node_update = False))
        elif not self.edge_ended:
            self.EGT_layers.append(EGT_Layer(**self.layer_common_kwargs, edge_update = False))
        else:
            self.EGT_layers.append(EGT_Layer(**self.layer_common_kwargs))

    def forward(self, inputs):
        g = self.input_block(inputs)

        for layer in self.EGT_layers:
            g = layer(g)

        g = self.final_embedding(g)

        outputs = self.output_block(g)
        return outputs


NODE_FEATURES_OFFSET = 128
NUM_NODE_FEATURES = 9
EDGE_FEATURES_OFFSET = 8
NUM_EDGE_FEATURES = 3


class EGT_MOL(EGT):
    def __init__(self,
                 upto_hop          = 16,
                 mlp_ratios        = [1., 1.],
                 num_virtual_nodes = 0,
                 svd_encodings     = 0,
                 output_dim        = 1,
                 **kwargs):
        super().__init__(node_ended=True, **kwargs)

        self.upto_hop          = upto_hop
        self.mlp_ratios        = mlp_ratios
        self.num_virtual_nodes = num_virtual_nodes
        self.svd_encodings     = svd_encodings
        self.output_dim        = output_dim

        self.nodef_embed = nn.Embedding(NUM_NODE_FEATURES*NODE_FEATURES_OFFSET+1,
                                        self.node_width, padding_idx=0)
        if self.svd_encodings:
            self.svd_embed = nn.Linear(self.svd_encodings*2, self.node_width)

        self.dist_embed = nn.Embedding(self.upto_hop+2, self.edge_width)
        self.featm_embed = nn.Embedding(NUM_EDGE_FEATURES*EDGE_FEATURES_OFFSET+1,
                                        self.edge_width, padding_idx=0)

        self.final_ln_h = nn.LayerNorm(self.node_width)
        mlp_dims = [self.node_width * max(self.num_virtual_nodes, 1)]\
                    +[round(self.node_width*r) for r in self.mlp_ratios]\
                        +[self.output_dim]
        self.mlp_layers = nn.ModuleList([nn.Linear(mlp_dims[i],mlp_dims[i+1])
                                         for i in range(len(mlp_dims)-1)])
        self.mlp_fn = getattr(F, self.activation)

    def input_block(self, inputs):
        g = super().input_block(inputs)
        nodef = g.node_features.long()              # (b,i,f)
        nodem = g.node_mask.float()                 # (b,i)

        dm0 = g.distance_matrix                     # (b,i,j)
        dm = dm0.long().clamp(max=self.upto_hop+1)  # (b,i,j)
        featm = g.feature_matrix.long()             # (b,i,j,f)

        h = self.nodef_embed(nodef).sum(dim=2)      # (b,i,w,h) -> (b,i,h)

        if self.svd_encodings:
            h = h + self.svd_embed(g.svd_encodings)

        e = self.dist_embed(dm)\
              + self.featm_embed(featm).sum(dim=3)  # (b,i,j,f,e) -> (b,i,j,e)

        g.mask = (nodem[:,:,None,None] * nodem[:,None,:,None] - 1)*1e9
        g.h, g.e = h, e
        return g

    def final_embedding(self, g):
        h = g.h
        h = self.final_ln_h(h)
        nodem = g.node_mask.float().unsqueeze(dim=-1)
        h = (h*nodem).sum(dim=1)/(nodem.sum(dim=1)+1e-9)
        g.h = h
        return g

    def output_block(self, g):
        h = g.h
        h = self.mlp_layers[0](h)
        for layer in self.mlp_layers[1:]:
            h = layer(self.mlp_fn(h))
        return h


class EGT_PCQM4MV2(EGT_MOL):
    def __init__(self, **kwargs):
        super().__init__(output_dim=1, **kwargs)

    def output_block(self, g):
        h = super().output_block(g)
        return h.squeeze(-1)


# ---- data: structural_dataset.py / graph_dataset.py / stack_with_pad.py (numba kernels as numpy) ----
def floyd_warshall(A):
    n = A.shape[0]
    D = np.zeros((n,n), dtype=np.int16)
    for i in range(n):
        for j in range(n):
            if i == j:
                pass
            elif A[i,j] == 0:
                D[i,j] = 510
            else:
                D[i,j] = 1
    for k in range(n):
        for i in range(n):
            for j in range(n):
                old_dist = D[i,j]
                new_dist = D[i,k] + D[k,j]
                if new_dist < old_dist:
                    D[i,j] = new_dist
    return D


def preprocess_data(num_nodes, edges, node_feats, edge_feats):
    node_feats = node_feats + np.arange(1,node_feats.shape[-1]*NODE_FEATURES_OFFSET+1,
                                            NODE_FEATURES_OFFSET,dtype=np.int16)
    edge_feats = edge_feats + np.arange(1,edge_feats.shape[-1]*EDGE_FEATURES_OFFSET+1,
                                            EDGE_FEATURES_OFFSET,dtype=np.int16)
    A = np.zeros((num_nodes,num_nodes),dtype=np.int16)
    E = np.zeros((num_nodes,num_nodes,edge_feats.shape[-1]),dtype=np.int16)
    for k in range(edges.shape[0]):
        i,j = edges[k,0], edges[k,1]
        A[i,j] = 1
        E[i,j] = edge_feats[k]
    D = floyd_warshall(A)
    return node_feats, D, E


def get_item(record):
    # GraphDataset.__getitem__ (node_mask) then StructuralDataset.__getitem__
    item = dict(record)
    item['node_mask'] = np.ones((item['num_nodes'],), dtype=np.uint8)
    num_nodes = int(item['num_nodes'])
    edges = item.pop('edges')
    node_feats = item.pop('node_features')
    edge_feats = item.pop('edge_features')
    node_feats, dist_mat, edge_feats_mat = preprocess_data(num_nodes, edges, node_feats, edge_feats)
    item['node_features'] = node_feats
    item['distance_matrix'] = dist_mat
    item['feature_matrix'] = edge_feats_mat
    return item


def stack_with_pad(inputs):
    if np.ndim(inputs[0]) == 0:
        return np.stack(inputs)
    shape = tuple(max(x.shape[d] for x in inputs) for d in range(np.ndim(inputs[0])))
    stacked = np.zeros((len(inputs),) + shape, dtype=inputs[0].dtype)
    for i, elem in enumerate(inputs):
        stacked[(i,) + tuple(slice(0, s) for s in elem.shape)] = elem
    return stacked


def graphdata_collate(batch):
    batch_data = defaultdict(list)
    for elem in batch:
        for k,v in elem.items():
            batch_data[k].append(v)
    out = {k:torch.from_numpy(stack_with_pad(dat))
                    for k, dat in batch_data.items()}
    return out


# ---- tiny molecules (ogb smiles2graph layout: 9 atom features, 3 bond features, both bond directions) ----
rng = np.random.default_rng(0)


def molecule(num_nodes, bonds):
    edges = np.array([p for a, b in bonds for p in ((a, b), (b, a))], dtype=np.int16)
    bond_feats = rng.integers(0, 4, (len(bonds), 3)).astype(np.int16)
    return dict(num_nodes=np.array(num_nodes, dtype=np.int16),
                edges=edges,
                edge_features=np.repeat(bond_feats, 2, axis=0),
                node_features=rng.integers(0, 12, (num_nodes, 9)).astype(np.int16),
                target=np.array(rng.normal(), np.float32))


records = [
    molecule(7, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 0), (2, 6)]),        # ring + substituent
    molecule(4, [(0, 1), (1, 2), (2, 3)]),                                        # chain
    molecule(10, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 0), (4, 5), (5, 6), (6, 7),
                  (7, 8), (8, 9)]),                                               # largest: sets the padding
    molecule(5, [(0, 1), (1, 2), (3, 4)]),                                        # two fragments (distance 510)
    molecule(2, [(0, 1)]),
]
items = [get_item(r) for r in records]
batch = graphdata_collate(items)

torch.manual_seed(0)
model = EGT_PCQM4MV2(node_width=16, edge_width=8, num_heads=4, model_height=3, node_ffn_multiplier=1.0,
                     edge_ffn_multiplier=1.0, upto_hop=4, scale_degree=True, num_virtual_nodes=0)
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.3 * torch.randn_like(p))   # LayerNorm affine and biases away from their init
model.eval()

with torch.no_grad():
    g = model.input_block(batch)
    for layer in model.EGT_layers:
        g = layer(g)
    h_nodes, e_pairs = g.h, g.e
    preds = model(batch)
loss = F.l1_loss(model(batch), batch['target'])
loss.backward()
grads = {n: p.grad.clone() for n, p in model.named_parameters()}
model.zero_grad()


# ---- reference: one molecule at a time, no padding and no mask, attention as a double loop ----
def ref_layer(layer, h, e):
    n, H, dd = h.shape[0], layer.num_heads, layer.dot_dim
    h_ln = F.layer_norm(h, (h.shape[-1],), layer.mha_ln_h.weight, layer.mha_ln_h.bias)
    e_ln = F.layer_norm(e, (e.shape[-1],), layer.mha_ln_e.weight, layer.mha_ln_e.bias)
    qkv = h_ln @ layer.lin_QKV.weight.T + layer.lin_QKV.bias
    Eb = e_ln @ layer.lin_E.weight.T + layer.lin_E.bias           # (n, n, H)
    # lin_QKV's output column d * H + k is channel d of head k; channels 0..dd-1 Q, dd..2dd-1 K, then V
    q = [qkv[:, [d * H + k for d in range(dd)]] for k in range(H)]
    kk = [qkv[:, [(dd + d) * H + k for d in range(dd)]] for k in range(H)]
    v = [qkv[:, [(2 * dd + d) * H + k for d in range(dd)]] for k in range(H)] if layer.node_update else None
    H_hat = torch.zeros(n, n, H)
    for k in range(H):
        for i in range(n):
            for j in range(n):
                s = float(q[k][i] @ kk[k][j]) / dd ** 0.5
                H_hat[i, j, k] = min(max(s, -5.0), 5.0) + Eb[i, j, k]
    if layer.node_update:
        Gb = e_ln @ layer.lin_G.weight.T + layer.lin_G.bias
        V_att = torch.zeros(n, dd, H)
        for k in range(H):
            for i in range(n):
                w = torch.exp(H_hat[i, :, k] - H_hat[i, :, k].max())
                w = w / w.sum()
                gate = torch.sigmoid(Gb[i, :, k])
                out = sum(w[j] * gate[j] * v[k][j] for j in range(n))
                V_att[i, :, k] = out * torch.log(1 + gate.sum()) if layer.scale_degree else out
        V_att = V_att.reshape(n, H * dd)
        h = V_att @ layer.lin_O_h.weight.T + layer.lin_O_h.bias + h
        t = F.layer_norm(h, (h.shape[-1],), layer.ffn_ln_h.weight, layer.ffn_ln_h.bias)
        h = layer.lin_W_h_2(F.elu(layer.lin_W_h_1(t))) + h
    if layer.edge_update:
        e = H_hat @ layer.lin_O_e.weight.T + layer.lin_O_e.bias + e
        t = F.layer_norm(e, (e.shape[-1],), layer.ffn_ln_e.weight, layer.ffn_ln_e.bias)
        e = layer.lin_W_e_2(F.elu(layer.lin_W_e_1(t))) + e
    return h, e


def ref_molecule(item):
    nf = torch.from_numpy(item['node_features'].astype(np.int64))
    D = torch.from_numpy(item['distance_matrix'].astype(np.int64)).clamp(max=model.upto_hop + 1)
    Ef = torch.from_numpy(item['feature_matrix'].astype(np.int64))
    h = model.nodef_embed.weight[nf].sum(1)
    e = model.dist_embed.weight[D] + model.featm_embed.weight[Ef].sum(2)
    for layer in model.EGT_layers:
        h, e = ref_layer(layer, h, e)
    r = F.layer_norm(h, (h.shape[-1],), model.final_ln_h.weight, model.final_ln_h.bias).mean(0)
    r = model.mlp_layers[0](r)
    for lin in model.mlp_layers[1:]:
        r = lin(F.elu(r))
    return h, e, r.squeeze(-1)


ref_loss = 0.0
for b, item in enumerate(items):
    n = int(item['num_nodes'])
    with torch.no_grad():
        h_ref, e_ref, y_ref = ref_molecule(item)
        y_alone = model(graphdata_collate([item]))
    assert torch.allclose(h_nodes[b, :n], h_ref, atol=1e-4), (b, (h_nodes[b, :n] - h_ref).abs().max())
    assert torch.allclose(e_pairs[b, :n, :n], e_ref, atol=1e-4), b
    assert torch.allclose(preds[b], y_ref, atol=1e-5), (b, preds[b], y_ref)
    assert torch.allclose(preds[b], y_alone[0], atol=1e-5), (b, preds[b], y_alone)
    ref_loss = ref_loss + (model(graphdata_collate([item])) - torch.from_numpy(item['target'])).abs().sum()
(ref_loss / len(items)).backward()
for name, p in model.named_parameters():
    assert torch.allclose(grads[name], p.grad, atol=1e-5), name
assert torch.allclose(loss, ref_loss.detach() / len(items), atol=1e-6)
print("ok", [round(float(x), 4) for x in preds])
