# Citation: lucidrains/se3-transformer-pytorch commit 2811715 ("fix all neighbors being masked
#   elements, leading to NaNs"), v0.0.23; code ported from its parent (3b71537).
# Upstream: se3_transformer_pytorch/utils.py masked_mean, used by ConvSE3.forward (pool=True) with the
#   neighbor_mask built in SE3Transformer.forward (neighbor_rel_dist <= valid_radius, & the pair mask
#   of the padding mask gathered at the nearest neighbours).
# Bug: masked_mean divides the masked neighbour sum by mask.sum(dim); a node whose neighbours are all
#   masked (a padded node, or an atom with no neighbour inside valid_radius) gets 0 / 0.
# Fix: total_el = mask.sum(dim); mean = sum / total_el.clamp(min = 1.); mean.masked_fill_(total_el == 0, 0.)
#
# Ported to plain torch (einops rearrange/repeat written out); only type-0 features are used
# (num_degrees = input_degrees = output_degrees = 1), so get_basis is written for max_degree 0
# (Y_0 = sqrt(1 / 4pi), Q_J = [[1]]). Everything else (including the neighbour-index construction) is as
# in the parent commit.
import sys
from math import sqrt, pi
from itertools import product
from collections import namedtuple

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv

# ---------------------------------------------------------------- utils.py

def exists(val):
    return val is not None

def default(val, d):
    return val if exists(val) else d

def uniq(arr):
    return list({el: True for el in arr}.keys())

def to_order(degree):
    return 2 * degree + 1

def batched_index_select(values, indices, dim = 1):
    value_dims = values.shape[(dim + 1):]
    values_shape, indices_shape = map(lambda t: list(t.shape), (values, indices))
    indices = indices[(..., *((None,) * len(value_dims)))]
    indices = indices.expand(*((-1,) * len(indices_shape)), *value_dims)
    value_expand_len = len(indices_shape) - (dim + 1)
    values = values[(*((slice(None),) * dim), *((None,) * value_expand_len), ...)]

    value_expand_shape = [-1] * len(values.shape)
    expand_slice = slice(dim, (dim + value_expand_len))
    value_expand_shape[expand_slice] = indices.shape[expand_slice]
    values = values.expand(*value_expand_shape)

    dim += value_expand_len
    return values.gather(dim, indices)

def masked_mean(tensor, mask, dim = -1):
    diff_len = len(tensor.shape) - len(mask.shape)
    mask = mask[(..., *((None,) * diff_len))]
    tensor.masked_fill_(~mask, 0.)
    if not FIXED:
        return tensor.sum(dim = dim) / mask.sum(dim = dim)

    total_el = mask.sum(dim = dim)
    mean = tensor.sum(dim = dim) / total_el.clamp(min = 1.)
    mean.masked_fill_(total_el == 0, 0.)
    return mean

# ---------------------------------------------------------------- basis.py (max_degree 0 only)

def get_basis(r_ij, max_degree, differentiable = False):
    assert max_degree == 0
    basis = {}
    for d_in, d_out in product(range(max_degree + 1), range(max_degree + 1)):
        Y0 = torch.full((*r_ij.shape[:-1], 1), sqrt(1. / (4 * pi)), dtype = r_ij.dtype)
        Q_J = torch.ones(1, 1, dtype = r_ij.dtype)
        K_J = torch.matmul(Y0, Q_J.T)
        K_Js = torch.stack([K_J], dim = -1)
        size = (*r_ij.shape[:-1], 1, to_order(d_out), 1, to_order(d_in), to_order(min(d_in, d_out)))
        basis[f'{d_in},{d_out}'] = K_Js.view(*size).detach()
    return basis

# ---------------------------------------------------------------- se3_transformer_pytorch.py

FiberEl = namedtuple('FiberEl', ['degrees', 'dim'])

class Fiber(nn.Module):
    def __init__(self, structure):
        super().__init__()
        if isinstance(structure, dict):
            structure = structure.items()
        self.structure = structure

    @property
    def dims(self):
        return uniq(map(lambda t: t[1], self.structure))

    @property
    def degrees(self):
        return map(lambda t: t[0], self.structure)

    @staticmethod
    def create(num_degrees, dim):
        return Fiber([FiberEl(degree, dim) for degree in range(num_degrees)])

    def __getitem__(self, degree):
        return dict(self.structure)[degree]

    def __iter__(self):
        return iter(self.structure)

    def __mul__(self, fiber):
        return product(self.structure, fiber.structure)

    def __and__(self, fiber):
        out = []
        for degree, dim in self:
            if degree in fiber.degrees:
                dim_out = fiber[degree]
                out.append((degree, dim, dim_out))
        return out

def get_tensor_device_and_dtype(features):
    first_tensor = next(iter(features.items()))[1]
    return first_tensor.device, first_tensor.dtype

class ResidualSE3(nn.Module):
    def forward(self, x, res):
        out = {}
        for degree, tensor in x.items():
            degree = str(degree)
            out[degree] = tensor
            if degree in res:
                out[degree] = out[degree] + res[degree]
        return out

class LinearSE3(nn.Module):
    def __init__(self, fiber_in, fiber_out):
        super().__init__()
        self.weights = nn.ParameterDict()
        for (degree, dim_in, dim_out) in (fiber_in & fiber_out):
            key = str(degree)
            self.weights[key] = nn.Parameter(torch.randn(dim_in, dim_out) / sqrt(dim_in))

    def forward(self, x):
        out = {}
        for degree, weight in self.weights.items():
            out[degree] = einsum('b n d m, d e -> b n e m', x[degree], weight)
        return out

class NormSE3(nn.Module):
    def __init__(self, fiber, nonlin = nn.GELU(), eps = 1e-12):
        super().__init__()
        self.fiber = fiber
        self.nonlin = nonlin
        self.eps = eps
        self.transform = nn.ModuleDict()
        for degree, chan in fiber:
            self.transform[str(degree)] = nn.Sequential(nn.LayerNorm(chan), nonlin)

    def forward(self, features):
        output = {}
        for degree, t in features.items():
            norm = t.norm(dim = -1, keepdim = True).clamp(min = self.eps)
            phase = t / norm
            fn = self.transform[degree]
            transformed = fn(norm.squeeze(-1))[..., None]
            output[degree] = (transformed * phase).view(*t.shape)
        return output

class ConvSE3(nn.Module):
    def __init__(self, fiber_in, fiber_out, self_interaction = True, pool = True, edge_dim = 0, fourier_encode_dist = False):
        super().__init__()
        self.fiber_in = fiber_in
        self.fiber_out = fiber_out
        self.edge_dim = edge_dim
        self.self_interaction = self_interaction

        self.kernel_unary = nn.ModuleDict()
        for (di, mi), (do, mo) in (self.fiber_in * self.fiber_out):
            self.kernel_unary[f'({di},{do})'] = PairwiseConv(di, mi, do, mo, edge_dim = edge_dim, fourier_encode_dist = fourier_encode_dist)

        self.pool = pool

        if self_interaction:
            assert self.pool, 'must pool edges if followed with self interaction'
            self.self_interact = LinearSE3(fiber_in, fiber_out)
            self.self_interact_sum = ResidualSE3()

    def forward(self, inp, edge_info, rel_dist = None, basis = None):
        neighbor_indices, neighbor_masks, edges = edge_info
        rel_dist = rel_dist.unsqueeze(-1)                       # 'b m n -> b m n ()'

        kernels = {}
        outputs = {}

        for (di, mi), (do, mo) in (self.fiber_in * self.fiber_out):
            etype = f'({di},{do})'
            kernel_fn = self.kernel_unary[etype]
            edge_features = torch.cat((rel_dist, edges), dim = -1) if exists(edges) else rel_dist
            kernels[etype] = kernel_fn(edge_features, basis = basis)

        for degree_out in self.fiber_out.degrees:
            output = 0
            degree_out_key = str(degree_out)

            for degree_in, m_in in self.fiber_in:
                x = inp[str(degree_in)]
                x = batched_index_select(x, neighbor_indices, dim = 1)
                x = x.view(*x.shape[:3], to_order(degree_in) * m_in, 1)

                etype = f'({degree_in},{degree_out})'
                kernel = kernels[etype]
                output = output + einsum('... o i, ... i c -> ... o c', kernel, x)

            if self.pool:
                output = masked_mean(output, neighbor_masks, dim = 2) if exists(neighbor_masks) else output.mean(dim = 2)

            leading_shape = x.shape[:2] if self.pool else x.shape[:3]
            output = output.view(*leading_shape, -1, to_order(degree_out))

            outputs[degree_out_key] = output

        if self.self_interaction:
            self_interact_out = self.self_interact(inp)
            outputs = self.self_interact_sum(outputs, self_interact_out)

        return outputs

class RadialFunc(nn.Module):
    def __init__(self, num_freq, in_dim, out_dim, edge_dim = None, fourier_encode_dist = False, num_fourier_features = 4, mid_dim = 16):
        super().__init__()
        self.num_freq = num_freq
        self.in_dim = in_dim
        self.mid_dim = mid_dim
        self.out_dim = out_dim
        self.edge_dim = default(edge_dim, 0)
        self.fourier_encode_dist = fourier_encode_dist
        self.num_fourier_features = num_fourier_features if fourier_encode_dist else 0
        input_dim = self.edge_dim + 1 + (self.num_fourier_features * 2)

        self.net = nn.Sequential(
            nn.Linear(input_dim, mid_dim),
            nn.LayerNorm(mid_dim),
            nn.ReLU(),
            nn.Linear(mid_dim, mid_dim),
            nn.LayerNorm(mid_dim),
            nn.ReLU(),
            nn.Linear(mid_dim, num_freq * in_dim * out_dim)
        )

    def forward(self, x):
        y = self.net(x)
        # '... (o i f) -> ... o () i () f'
        y = y.view(*y.shape[:-1], self.out_dim, self.in_dim, self.num_freq)
        return y.unsqueeze(-3).unsqueeze(-2)

class PairwiseConv(nn.Module):
    def __init__(self, degree_in, nc_in, degree_out, nc_out, edge_dim = 0, fourier_encode_dist = False):
        super().__init__()
        self.degree_in = degree_in
        self.degree_out = degree_out
        self.nc_in = nc_in
        self.nc_out = nc_out
        self.num_freq = to_order(min(degree_in, degree_out))
        self.d_out = to_order(degree_out)
        self.edge_dim = edge_dim
        self.rp = RadialFunc(self.num_freq, nc_in, nc_out, edge_dim, fourier_encode_dist)

    def forward(self, feat, basis):
        R = self.rp(feat)
        kernel = torch.sum(R * basis[f'{self.degree_in},{self.degree_out}'], dim = -1)
        out = kernel.view(*kernel.shape[:3], self.d_out * self.nc_out, -1)
        return out

class FeedForwardSE3(nn.Module):
    def __init__(self, fiber, mult = 4):
        super().__init__()
        self.fiber = fiber
        fiber_hidden = Fiber(list(map(lambda t: (t[0], t[1] * mult), fiber)))
        self.project_in = LinearSE3(fiber, fiber_hidden)
        self.nonlin = NormSE3(fiber_hidden)
        self.project_out = LinearSE3(fiber_hidden, fiber)

    def forward(self, features):
        outputs = self.project_in(features)
        outputs = self.nonlin(outputs)
        outputs = self.project_out(outputs)
        return outputs

class FeedForwardBlockSE3(nn.Module):
    def __init__(self, fiber):
        super().__init__()
        self.fiber = fiber
        self.prenorm = NormSE3(fiber)
        self.feedforward = FeedForwardSE3(fiber)
        self.residual = ResidualSE3()

    def forward(self, features):
        res = features
        out = self.prenorm(features)
        out = self.feedforward(out)
        return self.residual(out, res)

class AttentionSE3(nn.Module):
    def __init__(self, fiber, dim_head = 64, heads = 8, attend_self = False, edge_dim = None, fourier_encode_dist = False, use_null_kv = False):
        super().__init__()
        hidden_dim = dim_head * heads
        hidden_fiber = Fiber(list(map(lambda t: (t[0], hidden_dim), fiber)))
        project_out = not (heads == 1 and len(fiber.dims) == 1 and dim_head == fiber.dims[0])

        self.scale = dim_head ** -0.5
        self.heads = heads

        self.to_q = LinearSE3(fiber, hidden_fiber)
        self.to_k = ConvSE3(fiber, hidden_fiber, edge_dim = edge_dim, pool = False, self_interaction = False, fourier_encode_dist = fourier_encode_dist)
        self.to_v = ConvSE3(fiber, hidden_fiber, edge_dim = edge_dim, pool = False, self_interaction = False, fourier_encode_dist = fourier_encode_dist)
        self.to_out = LinearSE3(hidden_fiber, fiber) if project_out else nn.Identity()

        self.use_null_kv = use_null_kv
        if use_null_kv:
            self.null_keys = nn.ParameterDict()
            self.null_values = nn.ParameterDict()
            for degree in fiber.degrees:
                m = to_order(degree)
                degree_key = str(degree)
                self.null_keys[degree_key] = nn.Parameter(torch.zeros(heads, dim_head, m))
                self.null_values[degree_key] = nn.Parameter(torch.zeros(heads, dim_head, m))

        self.attend_self = attend_self
        if attend_self:
            self.to_self_k = LinearSE3(fiber, hidden_fiber)
            self.to_self_v = LinearSE3(fiber, hidden_fiber)

    def forward(self, features, edge_info, rel_dist, basis):
        h, attend_self = self.heads, self.attend_self
        device, dtype = get_tensor_device_and_dtype(features)
        neighbor_indices, neighbor_mask, edges = edge_info

        max_neg_value = -torch.finfo().max

        if exists(neighbor_mask):
            neighbor_mask = neighbor_mask.unsqueeze(1)                     # 'b i j -> b () i j'

        neighbor_indices = neighbor_indices.unsqueeze(1)

        queries = self.to_q(features)
        keys, values = self.to_k(features, edge_info, rel_dist, basis), self.to_v(features, edge_info, rel_dist, basis)

        if attend_self:
            self_keys, self_values = self.to_self_k(features), self.to_self_v(features)

        outputs = {}
        for degree in features.keys():
            q, k, v = map(lambda t: t[degree], (queries, keys, values))

            b, n = q.shape[:2]
            q = q.view(b, n, h, -1, q.shape[-1]).permute(0, 2, 1, 3, 4)                       # 'b i (h d) m -> b h i d m'
            k, v = map(lambda t: t.view(*t.shape[:3], h, -1, t.shape[-1]).permute(0, 3, 1, 2, 4, 5), (k, v))  # 'b i j (h d) m -> b h i j d m'

            if self.use_null_kv:
                null_k, null_v = map(lambda t: t[degree], (self.null_keys, self.null_values))
                null_k, null_v = map(lambda t: t[None, :, None, None].expand(b, -1, n, -1, -1, -1), (null_k, null_v))
                k = torch.cat((null_k, k), dim = 3)
                v = torch.cat((null_v, v), dim = 3)

            if attend_self:
                self_k, self_v = map(lambda t: t[degree], (self_keys, self_values))
                self_k, self_v = map(lambda t: t.view(b, n, h, -1, t.shape[-1]).permute(0, 2, 1, 3, 4).unsqueeze(3), (self_k, self_v))  # 'b n (h d) m -> b h n () d m'
                k = torch.cat((self_k, k), dim = 3)
                v = torch.cat((self_v, v), dim = 3)

            sim = einsum('b h i d m, b h i j d m -> b h i j', q, k) * self.scale

            if exists(neighbor_mask):
                num_left_pad = int(attend_self) + int(self.use_null_kv)
                mask = F.pad(neighbor_mask, (num_left_pad, 0), value = True)
                sim.masked_fill_(~mask, max_neg_value)

            attn = sim.softmax(dim = -1)
            out = einsum('b h i j, b h i j d m -> b h i d m', attn, v)
            outputs[degree] = out.permute(0, 2, 1, 3, 4).reshape(b, n, -1, out.shape[-1])  # 'b h n d m -> b n (h d) m'

        return self.to_out(outputs)

class AttentionBlockSE3(nn.Module):
    def __init__(self, fiber, dim_head = 64, heads = 8, attend_self = False, edge_dim = None, use_null_kv = False, fourier_encode_dist = False):
        super().__init__()
        self.attn = AttentionSE3(fiber, heads = heads, dim_head = dim_head, attend_self = attend_self, edge_dim = edge_dim, use_null_kv = use_null_kv)
        self.prenorm = NormSE3(fiber)
        self.residual = ResidualSE3()

    def forward(self, features, edge_info, rel_dist, basis):
        res = features
        outputs = self.prenorm(features)
        outputs = self.attn(outputs, edge_info, rel_dist, basis)
        return self.residual(outputs, res)

class SequentialSequence(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = blocks

    def forward(self, x, **kwargs):
        for (attn, ff) in self.blocks:
            x = attn(x, **kwargs)
            x = ff(x)
        return x

class SE3Transformer(nn.Module):
    def __init__(self, *, dim, num_neighbors = 12, heads = 8, dim_head = 64, depth = 2, num_degrees = 2,
                 input_degrees = 1, output_degrees = 2, valid_radius = 1e5, reduce_dim_out = False,
                 num_tokens = None, num_edge_tokens = None, edge_dim = None, reversible = False,
                 attend_self = True, use_null_kv = False, differentiable_coors = False, fourier_encode_dist = False):
        super().__init__()
        assert num_neighbors > 0, 'neighbors must be at least 1'
        self.dim = dim
        self.valid_radius = valid_radius

        self.token_emb = nn.Embedding(num_tokens, dim) if exists(num_tokens) else None
        self.edge_emb = nn.Embedding(num_edge_tokens, edge_dim) if exists(num_edge_tokens) else None

        self.input_degrees = input_degrees
        self.num_degrees = num_degrees
        self.num_neighbors = num_neighbors

        fiber_in = Fiber.create(input_degrees, dim)
        fiber_hidden = Fiber.create(num_degrees, dim)
        fiber_out = Fiber.create(output_degrees, dim)

        self.conv_in = ConvSE3(fiber_in, fiber_hidden, edge_dim = edge_dim, fourier_encode_dist = fourier_encode_dist)

        layers = nn.ModuleList([])
        for _ in range(depth):
            layers.append(nn.ModuleList([
                AttentionBlockSE3(fiber_hidden, heads = heads, dim_head = dim_head, attend_self = attend_self, edge_dim = edge_dim, fourier_encode_dist = fourier_encode_dist, use_null_kv = use_null_kv),
                FeedForwardBlockSE3(fiber_hidden)
            ]))

        self.net = SequentialSequence(layers)
        self.conv_out = ConvSE3(fiber_hidden, fiber_out, edge_dim = edge_dim, fourier_encode_dist = fourier_encode_dist)
        self.norm = NormSE3(fiber_out)
        self.linear_out = LinearSE3(fiber_out, Fiber.create(output_degrees, 1)) if reduce_dim_out else None
        self.differentiable_coors = differentiable_coors

    def forward(self, feats, coors, mask = None, edges = None, return_type = None):
        if exists(self.token_emb):
            feats = self.token_emb(feats)

        if exists(edges):
            edges = self.edge_emb(edges)

        if torch.is_tensor(feats):
            feats = {'0': feats[..., None]}

        b, n, d, *_, device = *feats['0'].shape, feats['0'].device

        num_degrees, neighbors = self.num_degrees, self.num_neighbors
        neighbors = min(neighbors, n - 1)

        # exclude edge of token to itself

        exclude_self_mask = (~torch.eye(n, dtype = torch.bool, device = device))[None]
        indices = torch.arange(n, device = device)[None, :, None].expand(b, n, n)   # repeat 'i -> b i j'
        rel_pos = coors[:, :, None, :] - coors[:, None, :, :]

        indices = indices.masked_select(exclude_self_mask).reshape(b, n, n - 1)
        rel_pos = rel_pos.masked_select(exclude_self_mask[..., None]).reshape(b, n, n - 1, 3)

        if exists(mask):
            mask = mask[:, :, None] * mask[:, None, :]
            mask = mask.masked_select(exclude_self_mask).reshape(b, n, n - 1)

        if exists(edges):
            edges = edges.masked_select(exclude_self_mask[..., None]).reshape(b, n, n - 1, -1)

        rel_dist = rel_pos.norm(dim = -1)

        # get neighbors and neighbor mask, excluding self

        neighbor_rel_dist, nearest_indices = rel_dist.topk(neighbors, dim = -1, largest = False)
        neighbor_rel_pos = batched_index_select(rel_pos, nearest_indices, dim = 2)
        neighbor_indices = batched_index_select(indices, nearest_indices, dim = 2)

        basis = get_basis(neighbor_rel_pos, num_degrees - 1, differentiable = self.differentiable_coors)

        neighbor_mask = neighbor_rel_dist <= self.valid_radius

        if exists(mask):
            neighbor_mask = neighbor_mask & batched_index_select(mask, nearest_indices, dim = 2)

        if exists(edges):
            edges = batched_index_select(edges, nearest_indices, dim = 2)

        edge_info = (neighbor_indices, neighbor_mask, edges)
        x = feats

        x = self.conv_in(x, edge_info, rel_dist = neighbor_rel_dist, basis = basis)
        x = self.net(x, edge_info = edge_info, rel_dist = neighbor_rel_dist, basis = basis)
        x = self.conv_out(x, edge_info, rel_dist = neighbor_rel_dist, basis = basis)
        x = self.norm(x)

        if exists(self.linear_out):
            x = self.linear_out(x)
            x = {k: v.squeeze(dim = 2) for k, v in x.items()}

        if exists(return_type):
            return x[str(return_type)]

        return x

# ---------------------------------------------------------------- a padded batch of small molecules

torch.manual_seed(0)

model = SE3Transformer(
    num_tokens = 10,
    dim = 8,
    heads = 2,
    dim_head = 4,
    depth = 1,
    num_degrees = 1,
    input_degrees = 1,
    output_degrees = 1,
    num_neighbors = 3,
    valid_radius = 2.0,
    reduce_dim_out = True,
    attend_self = True,
)

# molecule 0: 6 atoms in a cluster; molecule 1: 4 atoms (a salt: 3 bonded atoms + a counter-ion far away), padded to 6
n = 6
coors = torch.zeros(2, n, 3)
coors[0] = torch.randn(n, 3) * 0.6
coors[1, :3] = torch.randn(3, 3) * 0.6
coors[1, 3] = torch.tensor([6.0, 0.0, 0.0])
atoms = torch.randint(1, 10, (2, n))
atoms[1, 4:] = 0
mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])

out = model(atoms, coors, mask = mask, return_type = 0)   # (b, n, 1)
energy_per_atom = out[..., 0]
print("per-atom output, molecule 0:", [round(v, 4) for v in energy_per_atom[0].tolist()])
print("per-atom output, molecule 1:", [round(v, 4) for v in energy_per_atom[1].tolist()])

target = torch.tensor([1.0, -0.5])
pred = (energy_per_atom * mask).sum(dim = -1)
loss = F.mse_loss(pred, target)
loss.backward()
grad_norm = sum(p.grad.norm() ** 2 for p in model.parameters() if p.grad is not None) ** 0.5
print("molecule energies:", [round(v, 4) for v in pred.tolist()])
print("loss:", round(loss.item(), 6), "grad norm:", round(float(grad_norm), 6))
