"""lucidrains' graph-transformer-pytorch over a padded batch of molecular graphs with dense edge features.

Citation: lucidrains/graph-transformer-pytorch graph_transformer_pytorch/graph_transformer_pytorch.py
@282130d2b0b62f38dae9dedf26c5575bbe47a963 (Attention.forward: heads folded into the batch as `(b h)`, edge features
added to every query row's keys and values, `mask = rearrange(mask, 'b i -> b i ()') & rearrange(mask, 'b j -> b () j')`
repeated per head and flattened to `(b heads) i j`, `sim.masked_fill_(~mask, max_neg_value)`; GatedResidual,
PreNorm, FeedForward, GraphTransformer.forward).

einops' rearrange / repeat are written out as view / permute / expand (einops is not installed here); no rotary
embedding (rel_pos_emb=False, its default). The README's usage: nodes (B, N, dim), edges (B, N, N, edge_dim) and a
bool mask (B, N). Molecules are right-padded to the largest: pad atoms and every edge touching one are zeros.

Self-check: every real atom's node embedding after three layers (attention + feedforward, gated residuals) equals
the same model run on that molecule's graph alone, unpadded, with mask=None.
"""

import sys

import torch
from torch import nn, einsum

torch.manual_seed(0)

# helpers

def exists(val):
    return val is not None

def default(val, d):
    return val if exists(val) else d

List = nn.ModuleList

# normalizations

class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, *args, **kwargs):
        x = self.norm(x)
        return self.fn(x, *args, **kwargs)

# gated residual

class GatedResidual(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Sequential(
            nn.Linear(dim * 3, 1, bias = False),
            nn.Sigmoid()
        )

    def forward(self, x, res):
        gate_input = torch.cat((x, res, x - res), dim = -1)
        gate = self.proj(gate_input)
        return x * gate + res * (1 - gate)

# attention

def heads_to_batch(t, h):
    # rearrange(t, 'b ... (h d) -> (b h) ... d', h = h)
    b, *mid, hd = t.shape
    t = t.reshape(b, *mid, h, hd // h)
    t = t.movedim(-2, 1)
    return t.reshape(b * h, *mid, hd // h)

class Attention(nn.Module):
    def __init__(self, dim, pos_emb = None, dim_head = 64, heads = 8, edge_dim = None):
        super().__init__()
        edge_dim = default(edge_dim, dim)

        inner_dim = dim_head * heads
        self.heads = heads
        self.scale = dim_head ** -0.5

        self.pos_emb = pos_emb

        self.to_q = nn.Linear(dim, inner_dim)
        self.to_kv = nn.Linear(dim, inner_dim * 2)
        self.edges_to_kv = nn.Linear(edge_dim, inner_dim)

        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, nodes, edges, mask = None):
        h = self.heads

        q = self.to_q(nodes)
        k, v = self.to_kv(nodes).chunk(2, dim = -1)

        e_kv = self.edges_to_kv(edges)

        q, k, v, e_kv = map(lambda t: heads_to_batch(t, h), (q, k, v, e_kv))

        ek, ev = e_kv, e_kv

        k, v = map(lambda t: t[:, None], (k, v))  # 'b j d -> b () j d'
        k = k + ek
        v = v + ev

        sim = einsum('b i d, b i j d -> b i j', q, k) * self.scale

        if exists(mask):
            mask = mask[:, :, None] & mask[:, None, :]
            b, i, j = mask.shape
            mask = mask[:, None].expand(b, self.heads, i, j)  # "b i j -> b num_heads i j"
            mask = mask.reshape(b * self.heads, i, j)         # "b heads i j -> (b heads) i j"
            max_neg_value = -torch.finfo(sim.dtype).max
            sim.masked_fill_(~mask, max_neg_value)

        attn = sim.softmax(dim = -1)
        out = einsum('b i j, b i j d -> b i d', attn, v)
        bh, n, d = out.shape
        out = out.reshape(bh // h, h, n, d).permute(0, 2, 1, 3).reshape(bh // h, n, h * d)  # '(b h) n d -> b n (h d)'
        return self.to_out(out)

# optional feedforward

def FeedForward(dim, ff_mult = 4):
    return nn.Sequential(
        nn.Linear(dim, dim * ff_mult),
        nn.GELU(),
        nn.Linear(dim * ff_mult, dim)
    )

# classes

class GraphTransformer(nn.Module):
    def __init__(self, dim, depth, dim_head = 64, edge_dim = None, heads = 8, gated_residual = True,
                 with_feedforwards = False, norm_edges = False, rel_pos_emb = False):
        super().__init__()
        self.layers = List([])
        edge_dim = default(edge_dim, dim)
        self.norm_edges = nn.LayerNorm(edge_dim) if norm_edges else nn.Identity()

        pos_emb = None

        for _ in range(depth):
            self.layers.append(List([
                List([
                    PreNorm(dim, Attention(dim, pos_emb = pos_emb, edge_dim = edge_dim, dim_head = dim_head, heads = heads)),
                    GatedResidual(dim)
                ]),
                List([
                    PreNorm(dim, FeedForward(dim)),
                    GatedResidual(dim)
                ]) if with_feedforwards else None
            ]))

    def forward(self, nodes, edges, mask = None):
        edges = self.norm_edges(edges)

        for attn_block, ff_block in self.layers:
            attn, attn_residual = attn_block
            nodes = attn_residual(attn(nodes, edges, mask = mask), nodes)

            if exists(ff_block):
                ff, ff_residual = ff_block
                nodes = ff_residual(ff(nodes), nodes)

        return nodes, edges


def main():
    dim, edge_dim = 32, 8
    model = GraphTransformer(dim = dim, depth = 3, dim_head = 16, heads = 4, edge_dim = edge_dim,
                             with_feedforwards = True, norm_edges = True).eval()

    sizes = [9, 6, 3, 7]
    B, N = len(sizes), max(sizes)
    node_list = [torch.randn(n, dim) for n in sizes]
    edge_list = []
    for n in sizes:
        bonds = (torch.rand(n, n) < 0.4).float()
        bonds = ((bonds + bonds.T) > 0).float()
        edge_list.append(torch.randn(n, n, edge_dim) * bonds[..., None] + bonds[..., None])

    nodes = torch.zeros(B, N, dim)
    edges = torch.zeros(B, N, N, edge_dim)
    mask = torch.zeros(B, N, dtype = torch.bool)
    for b, n in enumerate(sizes):
        nodes[b, :n] = node_list[b]
        edges[b, :n, :n] = edge_list[b]
        mask[b, :n] = True

    with torch.no_grad():
        out, _ = model(nodes, edges, mask = mask)

        worst = 0.0
        for b, n in enumerate(sizes):
            ref, _ = model(node_list[b][None], edge_list[b][None])
            diff = (out[b, :n] - ref[0]).abs().max().item()
            worst = max(worst, diff)
            print(f"graph {b}: {n} atoms, max |nodes - ref| = {diff:.2e}")

    if worst > 1e-4:
        print("FAIL: padded batch differs from per-graph runs")
        return 1
    print("OK")
    return 0


if __name__ == '__main__':
    sys.exit(main())
