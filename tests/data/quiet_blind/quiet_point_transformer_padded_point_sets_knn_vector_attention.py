# Citation: lucidrains/point-transformer-pytorch point_transformer_pytorch/point_transformer_pytorch.py @16acc40
#   (PointTransformerLayer.forward with mask and num_neighbors).
# Masking: point clouds of different sizes are padded to n; the pair mask = mask_i * mask_j. Padded points get the
#   max distance so each real point's k nearest neighbours are real (every cloud has >= k points), and the vector
#   attention logits of any masked pair are filled with -max before the softmax over neighbours. Padded query rows
#   are fully masked on purpose; their outputs are excluded by the masked mean pooling of the classifier.
import torch
from torch import nn, einsum
import torch.nn.functional as F

torch.manual_seed(0)


def exists(val):
    return val is not None


def max_value(t):
    return torch.finfo(t.dtype).max


def batched_index_select(values, indices, dim=1):
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


class PointTransformerLayer(nn.Module):
    def __init__(self, *, dim, pos_mlp_hidden_dim=64, attn_mlp_hidden_mult=4, num_neighbors=None):
        super().__init__()
        self.num_neighbors = num_neighbors
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.pos_mlp = nn.Sequential(nn.Linear(3, pos_mlp_hidden_dim), nn.ReLU(), nn.Linear(pos_mlp_hidden_dim, dim))
        self.attn_mlp = nn.Sequential(nn.Linear(dim, dim * attn_mlp_hidden_mult), nn.ReLU(),
                                      nn.Linear(dim * attn_mlp_hidden_mult, dim))

    def forward(self, x, pos, mask=None):
        n, num_neighbors = x.shape[1], self.num_neighbors
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        rel_pos = pos[:, :, None, :] - pos[:, None, :, :]
        rel_pos_emb = self.pos_mlp(rel_pos)
        qk_rel = q[:, :, None, :] - k[:, None, :, :]
        if exists(mask):
            mask = mask[:, :, None] * mask[:, None, :]
        v = v[:, None].expand(-1, n, -1, -1)  # repeat(v, 'b j d -> b i j d', i = n)
        if exists(num_neighbors) and num_neighbors < n:
            rel_dist = rel_pos.norm(dim=-1)
            if exists(mask):
                mask_value = max_value(rel_dist)
                rel_dist.masked_fill_(~mask, mask_value)
            dist, indices = rel_dist.topk(num_neighbors, largest=False)
            v = batched_index_select(v, indices, dim=2)
            qk_rel = batched_index_select(qk_rel, indices, dim=2)
            rel_pos_emb = batched_index_select(rel_pos_emb, indices, dim=2)
            mask = batched_index_select(mask, indices, dim=2) if exists(mask) else None
        v = v + rel_pos_emb
        sim = self.attn_mlp(qk_rel + rel_pos_emb)
        if exists(mask):
            mask_value = -max_value(sim)
            sim.masked_fill_(~mask[..., None], mask_value)
        attn = sim.softmax(dim=-2)
        agg = einsum('b i j d, b i j d -> b i d', attn, v)
        return agg


class Classifier(nn.Module):
    def __init__(self, dim=32, classes=4):
        super().__init__()
        self.embed = nn.Linear(3, dim)
        self.layers = nn.ModuleList([PointTransformerLayer(dim=dim, pos_mlp_hidden_dim=32, attn_mlp_hidden_mult=2,
                                                           num_neighbors=8) for _ in range(2)])
        self.out = nn.Linear(dim, classes)

    def forward(self, pos, mask):
        x = self.embed(pos)
        for layer in self.layers:
            x = x + layer(x, pos, mask=mask)
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.out(pooled)


sizes = [40, 25, 12]
N = max(sizes)
pos = torch.zeros(3, N, 3)
mask = torch.zeros(3, N, dtype=torch.bool)
for i, s in enumerate(sizes):
    pos[i, :s] = torch.randn(s, 3)
    mask[i, :s] = True
model = Classifier()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
loss = F.cross_entropy(model(pos, mask), torch.tensor([0, 2, 3]))
loss.backward()
opt.step()
print(f"loss {loss.item():.4f}")
