"""QCNet agent encoder: factorized temporal / map-to-agent / agent-to-agent attention over a
PyG-style batch of two scenes whose agent tracks are padded in time (valid_mask).

Follows ZikangZhou/QCNet @5e55fdd57ed20269e832f8c6c05c0346940e6232:
  modules/qcnet_agent_encoder.py (QCNetAgentEncoder.forward: mask_t, dense_to_sparse,
      edge_index_t[1] > edge_index_t[0], time_span, radius(...) pl2a filtered by mask_s[dst],
      radius_graph(loop=False) a2a restricted by subgraph(mask_s), time-major node order)
  layers/attention_layer.py (AttentionLayer: MessagePassing aggr='add', torch_geometric softmax
      over the incoming edges of each target, gated update inputs + g * (to_s(x_dst) - inputs))
  layers/fourier_embedding.py (FourierEmbedding), utils/geometry.py (angle_between_2d_vectors, wrap_angle)
torch_geometric / torch_cluster (dense_to_sparse, subgraph, radius, radius_graph, softmax,
propagate) are written here in plain torch with the same semantics.

Masking is by edges, not by a dense mask: an agent-step attends only strictly earlier valid
steps of its own track within time_span (not itself), map polygons within pl2a_radius of the
same scene and time step, and other valid agents within a2a_radius of the same scene and time
step. Invalid agent-steps, and the first valid step of each track in the temporal layer, have
no incoming edges: the 'add' aggregation gives them 0 and the gate falls back to to_s(x_dst),
on purpose (no -inf row, no NaN).
Check: each scene run alone with a dense loop over target nodes and their allowed sources.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

HIDDEN, HEADS, HEAD_DIM, FREQ = 16, 2, 8, 4
T_HIST, TIME_SPAN = 6, 3
PL2A_R, A2A_R = 2.5, 3.0
NUM_LAYERS = 2


def angle_between_2d_vectors(ctr_vector, nbr_vector):
    return torch.atan2(ctr_vector[..., 0] * nbr_vector[..., 1] - ctr_vector[..., 1] * nbr_vector[..., 0],
                       (ctr_vector[..., :2] * nbr_vector[..., :2]).sum(dim=-1))


def wrap_angle(angle, min_val=-math.pi, max_val=math.pi):
    return min_val + (angle + max_val) % (max_val - min_val)


class FourierEmbedding(nn.Module):
    def __init__(self, input_dim, hidden_dim, num_freq_bands):
        super().__init__()
        self.input_dim = input_dim
        self.freqs = nn.Embedding(input_dim, num_freq_bands)
        self.mlps = nn.ModuleList([nn.Sequential(nn.Linear(num_freq_bands * 2 + 1, hidden_dim),
                                                 nn.LayerNorm(hidden_dim), nn.ReLU(inplace=True),
                                                 nn.Linear(hidden_dim, hidden_dim)) for _ in range(input_dim)])
        self.to_out = nn.Sequential(nn.LayerNorm(hidden_dim), nn.ReLU(inplace=True), nn.Linear(hidden_dim, hidden_dim))

    def forward(self, continuous_inputs, categorical_embs=None):
        x = continuous_inputs.unsqueeze(-1) * self.freqs.weight * 2 * math.pi
        x = torch.cat([x.cos(), x.sin(), continuous_inputs.unsqueeze(-1)], dim=-1)
        x = torch.stack([self.mlps[i](x[:, i]) for i in range(self.input_dim)]).sum(dim=0)
        if categorical_embs is not None:
            x = x + torch.stack(categorical_embs).sum(dim=0)
        return self.to_out(x)


# ---- plain-torch stand-ins for torch_geometric / torch_cluster --------------------------
def dense_to_sparse(adj):
    """(B, N, N) bool -> (2, E) with block offsets b * N (torch_geometric.utils.dense_to_sparse)."""
    b, r, c = adj.nonzero(as_tuple=True)
    return torch.stack([b * adj.size(1) + r, b * adj.size(2) + c]), None


def subgraph(subset, edge_index):
    keep = subset[edge_index[0]] & subset[edge_index[1]]
    return edge_index[:, keep], None


def radius(x, y, r, batch_x, batch_y, max_num_neighbors=300):
    """For each y, the x within r in the same batch: row 0 indexes y, row 1 indexes x."""
    d = torch.cdist(y, x)
    ok = (d <= r) & (batch_y[:, None] == batch_x[None, :])
    iy, ix = ok.nonzero(as_tuple=True)
    return torch.stack([iy, ix])


def radius_graph(x, r, batch, loop=False, max_num_neighbors=300):
    """Edges source -> target between nodes within r in the same batch (flow source_to_target)."""
    d = torch.cdist(x, x)
    ok = (d <= r) & (batch[:, None] == batch[None, :])
    if not loop:
        ok.fill_diagonal_(False)
    tgt, src = ok.nonzero(as_tuple=True)
    return torch.stack([src, tgt])


def pyg_softmax(src, index, num_nodes):
    """torch_geometric.utils.softmax: softmax of src over the entries sharing an index."""
    idx = index.view(-1, 1).expand_as(src)
    src_max = torch.full((num_nodes, src.size(1)), float("-inf")).scatter_reduce(
        0, idx, src, reduce="amax", include_self=True)
    out = (src - src_max[index]).exp()
    out_sum = torch.zeros(num_nodes, src.size(1)).scatter_add(0, idx, out) + 1e-16
    return out / out_sum[index]


class AttentionLayer(nn.Module):
    def __init__(self, hidden_dim, num_heads, head_dim, dropout, bipartite, has_pos_emb):
        super().__init__()
        self.num_heads, self.head_dim, self.has_pos_emb = num_heads, head_dim, has_pos_emb
        self.scale = head_dim ** -0.5
        self.to_q = nn.Linear(hidden_dim, head_dim * num_heads)
        self.to_k = nn.Linear(hidden_dim, head_dim * num_heads, bias=False)
        self.to_v = nn.Linear(hidden_dim, head_dim * num_heads)
        self.to_k_r = nn.Linear(hidden_dim, head_dim * num_heads, bias=False)
        self.to_v_r = nn.Linear(hidden_dim, head_dim * num_heads)
        self.to_s = nn.Linear(hidden_dim, head_dim * num_heads)
        self.to_g = nn.Linear(head_dim * num_heads + hidden_dim, head_dim * num_heads)
        self.to_out = nn.Linear(head_dim * num_heads, hidden_dim)
        self.attn_drop = nn.Dropout(dropout)
        self.ff_mlp = nn.Sequential(nn.Linear(hidden_dim, hidden_dim * 4), nn.ReLU(inplace=True),
                                    nn.Dropout(dropout), nn.Linear(hidden_dim * 4, hidden_dim))
        self.attn_prenorm_x_src = nn.LayerNorm(hidden_dim)
        self.attn_prenorm_x_dst = nn.LayerNorm(hidden_dim) if bipartite else self.attn_prenorm_x_src
        self.attn_prenorm_r = nn.LayerNorm(hidden_dim)
        self.attn_postnorm = nn.LayerNorm(hidden_dim)
        self.ff_prenorm = nn.LayerNorm(hidden_dim)
        self.ff_postnorm = nn.LayerNorm(hidden_dim)

    def forward(self, x, r, edge_index):
        if isinstance(x, torch.Tensor):
            x_src = x_dst = self.attn_prenorm_x_src(x)
        else:
            x_src, x_dst = x
            x_src = self.attn_prenorm_x_src(x_src)
            x_dst = self.attn_prenorm_x_dst(x_dst)
            x = x[1]
        r = self.attn_prenorm_r(r)
        x = x + self.attn_postnorm(self._attn_block(x_src, x_dst, r, edge_index))
        x = x + self.ff_postnorm(self.ff_mlp(self.ff_prenorm(x)))
        return x

    def _attn_block(self, x_src, x_dst, r, edge_index):
        q = self.to_q(x_dst).view(-1, self.num_heads, self.head_dim)
        k = self.to_k(x_src).view(-1, self.num_heads, self.head_dim)
        v = self.to_v(x_src).view(-1, self.num_heads, self.head_dim)
        # propagate(): x_j from edge_index[0], x_i / index from edge_index[1]
        j, i = edge_index[0], edge_index[1]
        q_i, k_j, v_j = q[i], k[j], v[j]
        k_j = k_j + self.to_k_r(r).view(-1, self.num_heads, self.head_dim)
        v_j = v_j + self.to_v_r(r).view(-1, self.num_heads, self.head_dim)
        sim = (q_i * k_j).sum(dim=-1) * self.scale
        attn = self.attn_drop(pyg_softmax(sim, i, x_dst.size(0)))
        msg = v_j * attn.unsqueeze(-1)
        inputs = torch.zeros(x_dst.size(0), self.num_heads, self.head_dim).index_add_(0, i, msg)  # aggr='add'
        inputs = inputs.view(-1, self.num_heads * self.head_dim)
        g = torch.sigmoid(self.to_g(torch.cat([inputs, x_dst], dim=-1)))
        return self.to_out(inputs + g * (self.to_s(x_dst) - inputs))


class QCNetAgentEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_historical_steps, self.time_span, self.hidden_dim = T_HIST, TIME_SPAN, HIDDEN
        self.type_a_emb = nn.Embedding(10, HIDDEN)
        self.x_a_emb = FourierEmbedding(4, HIDDEN, FREQ)
        self.r_t_emb = FourierEmbedding(4, HIDDEN, FREQ)
        self.r_pl2a_emb = FourierEmbedding(3, HIDDEN, FREQ)
        self.r_a2a_emb = FourierEmbedding(3, HIDDEN, FREQ)
        mk = lambda bip: AttentionLayer(HIDDEN, HEADS, HEAD_DIM, 0.1, bipartite=bip, has_pos_emb=True)
        self.t_attn_layers = nn.ModuleList([mk(False) for _ in range(NUM_LAYERS)])
        self.pl2a_attn_layers = nn.ModuleList([mk(True) for _ in range(NUM_LAYERS)])
        self.a2a_attn_layers = nn.ModuleList([mk(False) for _ in range(NUM_LAYERS)])

    def embed_agents(self, d):
        pos_a, head_a, vel, mask = d["position"], d["heading"], d["velocity"], d["valid_mask"]
        motion = torch.cat([pos_a.new_zeros(pos_a.size(0), 1, 2), pos_a[:, 1:] - pos_a[:, :-1]], dim=1)
        head_vec = torch.stack([head_a.cos(), head_a.sin()], dim=-1)
        x_a = torch.stack([torch.norm(motion, dim=-1), angle_between_2d_vectors(head_vec, motion),
                           torch.norm(vel, dim=-1), angle_between_2d_vectors(head_vec, vel)], dim=-1)
        cat = [self.type_a_emb(d["type"]).repeat_interleave(repeats=self.num_historical_steps, dim=0)]
        x_a = self.x_a_emb(x_a.view(-1, 4), cat).view(-1, self.num_historical_steps, self.hidden_dim)
        return x_a

    def forward(self, d, x_pl):
        mask = d["valid_mask"]
        pos_a, head_a = d["position"], d["heading"]
        head_vector_a = torch.stack([head_a.cos(), head_a.sin()], dim=-1)
        pos_pl, orient_pl = d["pl_position"], d["pl_orientation"]
        x_a = self.embed_agents(d)

        pos_t = pos_a.reshape(-1, 2)
        head_t = head_a.reshape(-1)
        head_vector_t = head_vector_a.reshape(-1, 2)
        mask_t = mask.unsqueeze(2) & mask.unsqueeze(1)
        edge_index_t = dense_to_sparse(mask_t)[0]
        edge_index_t = edge_index_t[:, edge_index_t[1] > edge_index_t[0]]
        edge_index_t = edge_index_t[:, edge_index_t[1] - edge_index_t[0] <= self.time_span]
        rel_pos_t = pos_t[edge_index_t[0]] - pos_t[edge_index_t[1]]
        rel_head_t = wrap_angle(head_t[edge_index_t[0]] - head_t[edge_index_t[1]])
        r_t = torch.stack([torch.norm(rel_pos_t, dim=-1),
                           angle_between_2d_vectors(head_vector_t[edge_index_t[1]], rel_pos_t),
                           rel_head_t, (edge_index_t[0] - edge_index_t[1]).float()], dim=-1)
        r_t = self.r_t_emb(r_t)

        T = self.num_historical_steps
        pos_s = pos_a.transpose(0, 1).reshape(-1, 2)
        head_s = head_a.transpose(0, 1).reshape(-1)
        head_vector_s = head_vector_a.transpose(0, 1).reshape(-1, 2)
        mask_s = mask.transpose(0, 1).reshape(-1)
        pos_pl_s = pos_pl.repeat(T, 1)
        orient_pl_s = orient_pl.repeat(T)
        G = d["num_graphs"]
        batch_s = torch.cat([d["batch"] + G * t for t in range(T)])
        batch_pl = torch.cat([d["pl_batch"] + G * t for t in range(T)])
        edge_index_pl2a = radius(x=pos_s, y=pos_pl_s, r=PL2A_R, batch_x=batch_s, batch_y=batch_pl)
        edge_index_pl2a = edge_index_pl2a[:, mask_s[edge_index_pl2a[1]]]
        rel_pos_pl2a = pos_pl_s[edge_index_pl2a[0]] - pos_s[edge_index_pl2a[1]]
        rel_orient_pl2a = wrap_angle(orient_pl_s[edge_index_pl2a[0]] - head_s[edge_index_pl2a[1]])
        r_pl2a = self.r_pl2a_emb(torch.stack([torch.norm(rel_pos_pl2a, dim=-1),
                                              angle_between_2d_vectors(head_vector_s[edge_index_pl2a[1]], rel_pos_pl2a),
                                              rel_orient_pl2a], dim=-1))
        edge_index_a2a = radius_graph(x=pos_s, r=A2A_R, batch=batch_s, loop=False)
        edge_index_a2a = subgraph(subset=mask_s, edge_index=edge_index_a2a)[0]
        rel_pos_a2a = pos_s[edge_index_a2a[0]] - pos_s[edge_index_a2a[1]]
        rel_head_a2a = wrap_angle(head_s[edge_index_a2a[0]] - head_s[edge_index_a2a[1]])
        r_a2a = self.r_a2a_emb(torch.stack([torch.norm(rel_pos_a2a, dim=-1),
                                            angle_between_2d_vectors(head_vector_s[edge_index_a2a[1]], rel_pos_a2a),
                                            rel_head_a2a], dim=-1))

        x_pl_s = x_pl.unsqueeze(1).expand(-1, T, -1).transpose(0, 1).reshape(-1, self.hidden_dim)
        for i in range(NUM_LAYERS):
            x_a = x_a.reshape(-1, self.hidden_dim)
            x_a = self.t_attn_layers[i](x_a, r_t, edge_index_t)
            x_a = x_a.reshape(-1, T, self.hidden_dim).transpose(0, 1).reshape(-1, self.hidden_dim)
            x_a = self.pl2a_attn_layers[i]((x_pl_s, x_a), r_pl2a, edge_index_pl2a)
            x_a = self.a2a_attn_layers[i](x_a, r_a2a, edge_index_a2a)
            x_a = x_a.reshape(T, -1, self.hidden_dim).transpose(0, 1)
        return x_a


# ---- independent reference: one scene, loops over targets and allowed sources ----------
def ref_attn(layer, x_src_raw, x_dst_raw, bipartite, pairs, r_fn):
    """pairs[i] = list of source indices target i may read; r_fn(i, js) -> raw edge features."""
    xs = layer.attn_prenorm_x_src(x_src_raw)
    xd = layer.attn_prenorm_x_dst(x_dst_raw) if bipartite else xs
    H, Dh = layer.num_heads, layer.head_dim
    outs = []
    for i in range(x_dst_raw.size(0)):
        js = pairs[i]
        if len(js) == 0:
            agg = torch.zeros(H * Dh)
        else:
            r = layer.attn_prenorm_r(r_fn(i, js))
            q = layer.to_q(xd[i]).view(H, Dh)
            k = layer.to_k(xs[js]).view(-1, H, Dh) + layer.to_k_r(r).view(-1, H, Dh)
            v = layer.to_v(xs[js]).view(-1, H, Dh) + layer.to_v_r(r).view(-1, H, Dh)
            w = torch.softmax((k * q).sum(-1) * layer.scale, dim=0)          # over allowed sources
            agg = (w.unsqueeze(-1) * v).sum(0).reshape(-1)
        g = torch.sigmoid(layer.to_g(torch.cat([agg, xd[i]])))
        outs.append(agg + g * (layer.to_s(xd[i]) - agg))
    a = layer.to_out(torch.stack(outs))
    x = x_dst_raw + layer.attn_postnorm(a)
    return x + layer.ff_postnorm(layer.ff_mlp(layer.ff_prenorm(x)))


def reference_scene(enc, d, x_pl):
    mask, pos, head = d["valid_mask"], d["position"], d["heading"]
    hv = torch.stack([head.cos(), head.sin()], dim=-1)
    N, T = mask.shape
    x = enc.embed_agents(d)                                     # (N, T, C)
    pos_pl, orient_pl = d["pl_position"], d["pl_orientation"]

    def r_t(n):
        def f(t, ss):
            rel = pos[n, ss] - pos[n, t]
            return enc.r_t_emb(torch.stack([rel.norm(dim=-1), angle_between_2d_vectors(hv[n, t].expand_as(rel), rel),
                                            wrap_angle(head[n, ss] - head[n, t]),
                                            torch.tensor(ss, dtype=torch.float) - t], dim=-1))
        return f

    for l in range(NUM_LAYERS):
        new = []
        for n in range(N):
            pairs = [[s for s in range(T) if mask[n, s] and mask[n, t] and s < t and t - s <= TIME_SPAN]
                     for t in range(T)]
            new.append(ref_attn(enc.t_attn_layers[l], x[n], x[n], False, pairs, r_t(n)))
        x = torch.stack(new)
        new = []
        for t in range(T):
            xt = x[:, t]
            pairs = [[p for p in range(pos_pl.size(0)) if mask[n, t] and (pos_pl[p] - pos[n, t]).norm() <= PL2A_R]
                     for n in range(N)]

            def f_pl(n, ps, t=t):
                rel = pos_pl[ps] - pos[n, t]
                return enc.r_pl2a_emb(torch.stack([rel.norm(dim=-1), angle_between_2d_vectors(hv[n, t].expand_as(rel), rel),
                                                   wrap_angle(orient_pl[ps] - head[n, t])], dim=-1))
            xt = ref_attn(enc.pl2a_attn_layers[l], x_pl, xt, True, pairs, f_pl)
            pairs = [[m for m in range(N) if m != n and mask[n, t] and mask[m, t]
                      and (pos[m, t] - pos[n, t]).norm() <= A2A_R] for n in range(N)]

            def f_a(n, ms, t=t):
                rel = pos[ms, t] - pos[n, t]
                return enc.r_a2a_emb(torch.stack([rel.norm(dim=-1), angle_between_2d_vectors(hv[n, t].expand_as(rel), rel),
                                                  wrap_angle(head[ms, t] - head[n, t])], dim=-1))
            new.append(ref_attn(enc.a2a_attn_layers[l], xt, xt, False, pairs, f_a))
        x = torch.stack(new, dim=1)
    return x


def make_scene(n_agents, n_pl):
    pos = torch.cumsum(torch.randn(n_agents, T_HIST, 2) * 0.6, dim=1) + torch.randn(n_agents, 1, 2) * 1.5
    mask = torch.ones(n_agents, T_HIST, dtype=torch.bool)
    return {"position": pos, "heading": torch.rand(n_agents, T_HIST) * 6 - 3,
            "velocity": torch.randn(n_agents, T_HIST, 2), "valid_mask": mask,
            "type": torch.randint(0, 10, (n_agents,)),
            "pl_position": torch.randn(n_pl, 2) * 2, "pl_orientation": torch.rand(n_pl) * 6 - 3}


def main():
    s0, s1 = make_scene(4, 5), make_scene(3, 4)
    # tracks padded in time: agents appear late / vanish early
    s0["valid_mask"][1, :3] = False
    s0["valid_mask"][2, 4:] = False
    s0["valid_mask"][3, ::2] = False
    s1["valid_mask"][0, :5] = False          # only the current step observed
    s1["valid_mask"][2, 1:4] = False
    x_pl0, x_pl1 = torch.randn(5, HIDDEN), torch.randn(4, HIDDEN)

    keys = ["position", "heading", "velocity", "valid_mask", "type", "pl_position", "pl_orientation"]
    batch = {k: torch.cat([s0[k], s1[k]]) for k in keys}
    batch["num_graphs"] = 2
    batch["batch"] = torch.tensor([0] * 4 + [1] * 3)
    batch["pl_batch"] = torch.tensor([0] * 5 + [1] * 4)

    enc = QCNetAgentEncoder().eval()
    with torch.no_grad():
        out = enc(batch, torch.cat([x_pl0, x_pl1]))
        r0 = reference_scene(enc, s0, x_pl0)
        r1 = reference_scene(enc, s1, x_pl1)
    ref = torch.cat([r0, r1])
    diff = (out - ref).abs().max().item()
    ok = torch.allclose(out, ref, atol=1e-5, rtol=1e-4) and bool(torch.isfinite(out).all())
    print(f"batched vs per-scene reference: max |diff| {diff:.2e}, "
          f"{int(batch['valid_mask'].sum())} valid agent-steps of {batch['valid_mask'].numel()}")
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
