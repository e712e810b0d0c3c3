"""MTR (Motion Transformer) context encoder: local attention over the *packed* valid
agent + map polyline tokens of a padded batch of scenes.

Follows sshaoshuai/MTR @99afddb0d2e1b1e0b7fd42e7fdd7944312cb6dc8:
  mtr/models/context_encoder/mtr_encoder.py      (MTREncoder.forward, apply_local_attn)
  mtr/models/utils/transformer/multi_head_attention_local.py (MultiheadAttentionLocal)
  mtr/models/utils/transformer/transformer_encoder_layer.py  (forward_post, q = k = src + pos)
  mtr/models/utils/polyline_encoder.py           (PointNetPolylineEncoder, masked points)
The CUDA ops (knn_utils.knn_batch_mlogk, attention.attention_weight_computation /
attention_value_computation) are written here in plain torch with the same contract:
index_pair[n, m] is the m-th nearest key of query n, counted from the start of the query's
scene in the packed key array, and -1 where the scene has fewer than K valid tokens.

Masking: padded objects / polylines are dropped before attention (x_stack_full[x_mask_stack]),
each valid token attends only its K nearest valid tokens of its own scene (itself included),
the -1 slots of index_pair are filled with -inf before the softmax over the K slots, and the
outputs are scattered back into a zero (batch, N, C) buffer, so padded slots stay zero.
Check: every scene run alone on its unpadded valid tokens with a dense (n, n) bool kNN mask.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

D_MODEL = 32
NHEAD = 4
NUM_LAYERS = 2
K_NEIGHBORS = 5


def gen_sineembed_for_position(pos_tensor, hidden_dim=256):
    """position_encoding_utils.gen_sineembed_for_position (x, y only)."""
    half_hidden_dim = hidden_dim // 2
    scale = 2 * math.pi
    dim_t = torch.arange(half_hidden_dim, dtype=torch.float32, device=pos_tensor.device)
    dim_t = 10000 ** (2 * (dim_t // 2) / half_hidden_dim)
    x_embed = pos_tensor[:, :, 0] * scale
    y_embed = pos_tensor[:, :, 1] * scale
    pos_x = x_embed[:, :, None] / dim_t
    pos_y = y_embed[:, :, None] / dim_t
    pos_x = torch.stack((pos_x[:, :, 0::2].sin(), pos_x[:, :, 1::2].cos()), dim=3).flatten(2)
    pos_y = torch.stack((pos_y[:, :, 0::2].sin(), pos_y[:, :, 1::2].cos()), dim=3).flatten(2)
    return torch.cat((pos_y, pos_x), dim=2)


def get_batch_offsets(batch_idxs, bs):
    batch_offsets = torch.zeros(bs + 1).int()
    for k in range(bs):
        batch_offsets[k + 1] = batch_offsets[k] + (batch_idxs == k).sum()
    return batch_offsets


# ---- plain-torch stand-ins for MTR's CUDA ops -------------------------------------------
def knn_batch_mlogk(xyz, query_xyz, batch_idxs, query_batch_offsets, k):
    """For every query, the k nearest keys of the same scene, as indices counted from the
    scene's first key; -1 where the scene holds fewer than k keys."""
    n = query_xyz.shape[0]
    idx = torch.full((n, k), -1, dtype=torch.int32)
    for b in range(query_batch_offsets.numel() - 1):
        s, e = int(query_batch_offsets[b]), int(query_batch_offsets[b + 1])
        if e == s:
            continue
        d = torch.cdist(query_xyz[s:e], xyz[s:e])
        kk = min(k, e - s)
        nn_idx = d.topk(kk, dim=1, largest=False).indices
        idx[s:e, :kk] = nn_idx.int()
    return idx


def _key_start(key_batch_cnt, index_pair_batch):
    starts = torch.cat([key_batch_cnt.new_zeros(1), key_batch_cnt.cumsum(0)[:-1]])
    return starts[index_pair_batch.long()].long()


def attention_weight_computation(query_batch_cnt, key_batch_cnt, index_pair_batch, index_pair, q, k):
    start = _key_start(key_batch_cnt, index_pair_batch)          # (Nq,)
    gidx = start[:, None] + index_pair.long().clamp(min=0)       # (Nq, M)
    kk = k[gidx]                                                 # (Nq, M, H, Dh)
    w = (q[:, None] * kk).sum(-1)                                # (Nq, M, H)
    return w.masked_fill((index_pair == -1)[..., None], 0.0)     # the kernel skips -1 pairs


def attention_value_computation(query_batch_cnt, key_batch_cnt, index_pair_batch, index_pair, attn_weight, v):
    start = _key_start(key_batch_cnt, index_pair_batch)
    gidx = start[:, None] + index_pair.long().clamp(min=0)
    vv = v[gidx]                                                 # (Nq, M, H, Dh)
    w = attn_weight.masked_fill((index_pair == -1)[..., None], 0.0)
    return (w[..., None] * vv).sum(1)                            # (Nq, H, Dh)


class MultiheadAttentionLocal(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.normal_(self.in_proj_bias, std=0.02)

    def _proj_qkv(self, t, start, end):
        return F.linear(t, self.in_proj_weight[start:end, :], self.in_proj_bias[start:end])

    def forward(self, query, key, value, index_pair, query_batch_cnt, key_batch_cnt, index_pair_batch,
                attn_mask=None, **kwargs):
        total_query_len, embed_dim = query.size()
        scaling = float(self.head_dim) ** -0.5
        q = self._proj_qkv(query, 0, embed_dim) * scaling
        k = self._proj_qkv(key, embed_dim, embed_dim * 2)
        v = self._proj_qkv(value, embed_dim * 2, embed_dim * 3)

        used_attn_mask = (index_pair == -1)  # -1 pairs do not join the attention
        if attn_mask is not None:
            used_attn_mask = torch.logical_or(used_attn_mask, attn_mask.to(torch.bool))

        q = q.contiguous().view(total_query_len, self.num_heads, self.head_dim)
        k = k.contiguous().view(-1, self.num_heads, self.head_dim)
        v = v.contiguous().view(-1, self.num_heads, self.head_dim)

        w = attention_weight_computation(query_batch_cnt, key_batch_cnt, index_pair_batch, index_pair, q, k)
        used_attn_mask = used_attn_mask.unsqueeze(-1).repeat(1, 1, self.num_heads).contiguous()
        w.masked_fill_(used_attn_mask, float("-inf"))
        w = F.softmax(w, dim=1)
        w = F.dropout(w, p=self.dropout, training=self.training)
        out = attention_value_computation(query_batch_cnt, key_batch_cnt, index_pair_batch, index_pair, w, v)
        out = out.view(total_query_len, embed_dim)
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        return out, w.sum(dim=-1) / self.num_heads


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward, dropout=0.1):
        super().__init__()
        self.self_attn = MultiheadAttentionLocal(d_model, nhead, dropout=dropout)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, src, pos=None, index_pair=None, query_batch_cnt=None, key_batch_cnt=None,
                index_pair_batch=None):
        q = k = src if pos is None else src + pos
        src2 = self.self_attn(q, k, value=src, index_pair=index_pair, query_batch_cnt=query_batch_cnt,
                              key_batch_cnt=key_batch_cnt, index_pair_batch=index_pair_batch)[0]
        src = self.norm1(src + self.dropout1(src2))
        src2 = self.linear2(self.dropout(F.relu(self.linear1(src))))
        return self.norm2(src + self.dropout2(src2))


class PointNetPolylineEncoder(nn.Module):
    """Masked point MLP + max pool; invalid polylines give zero features."""

    def __init__(self, in_channels, hidden_dim, out_channels):
        super().__init__()
        self.pre_mlps = nn.Sequential(nn.Linear(in_channels, hidden_dim), nn.ReLU())
        self.mlps = nn.Sequential(nn.Linear(hidden_dim * 2, hidden_dim), nn.ReLU())
        self.out_mlps = nn.Sequential(nn.Linear(hidden_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, out_channels))

    def forward(self, polylines, polylines_mask):
        bs, num_polylines, num_points_each_polylines, C = polylines.shape
        x_valid = self.pre_mlps(polylines[polylines_mask])
        polylines_feature = polylines.new_zeros(bs, num_polylines, num_points_each_polylines, x_valid.shape[-1])
        polylines_feature[polylines_mask] = x_valid
        pooled_feature = polylines_feature.max(dim=2)[0]
        polylines_feature = torch.cat(
            (polylines_feature, pooled_feature[:, :, None, :].repeat(1, 1, num_points_each_polylines, 1)), dim=-1)
        x_valid = self.mlps(polylines_feature[polylines_mask])
        feature_buffers = polylines_feature.new_zeros(bs, num_polylines, num_points_each_polylines, x_valid.shape[-1])
        feature_buffers[polylines_mask] = x_valid
        feature_buffers = feature_buffers.max(dim=2)[0]
        valid_mask = (polylines_mask.sum(dim=-1) > 0)
        feature_buffers_valid = self.out_mlps(feature_buffers[valid_mask])
        out = feature_buffers.new_zeros(bs, num_polylines, feature_buffers_valid.shape[-1])
        out[valid_mask] = feature_buffers_valid
        return out


class MTREncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.agent_polyline_encoder = PointNetPolylineEncoder(4 + 1, 16, D_MODEL)
        self.map_polyline_encoder = PointNetPolylineEncoder(5, 16, D_MODEL)
        self.self_attn_layers = nn.ModuleList(
            [TransformerEncoderLayer(D_MODEL, NHEAD, D_MODEL * 4, dropout=0.1) for _ in range(NUM_LAYERS)])

    def apply_local_attn(self, x, x_mask, x_pos, num_of_neighbors):
        assert torch.all(x_mask.sum(dim=-1) > 0)
        batch_size, N, d_model = x.shape
        x_stack_full = x.view(-1, d_model)
        x_mask_stack = x_mask.view(-1)
        x_pos_stack_full = x_pos.view(-1, 3)
        batch_idxs_full = torch.arange(batch_size).type_as(x)[:, None].repeat(1, N).view(-1).int()

        x_stack = x_stack_full[x_mask_stack]
        x_pos_stack = x_pos_stack_full[x_mask_stack]
        batch_idxs = batch_idxs_full[x_mask_stack]

        batch_offsets = get_batch_offsets(batch_idxs=batch_idxs, bs=batch_size).int()
        batch_cnt = batch_offsets[1:] - batch_offsets[:-1]
        index_pair = knn_batch_mlogk(x_pos_stack, x_pos_stack, batch_idxs, batch_offsets, num_of_neighbors)

        pos_embedding = gen_sineembed_for_position(x_pos_stack[None, :, 0:2], hidden_dim=d_model)[0]

        output = x_stack
        for layer in self.self_attn_layers:
            output = layer(src=output, pos=pos_embedding, index_pair=index_pair, query_batch_cnt=batch_cnt,
                           key_batch_cnt=batch_cnt, index_pair_batch=batch_idxs)

        ret_full_feature = torch.zeros_like(x_stack_full)
        ret_full_feature[x_mask_stack] = output
        return ret_full_feature.view(batch_size, N, d_model)

    def forward(self, obj_trajs, obj_trajs_mask, map_polylines, map_polylines_mask, obj_trajs_last_pos,
                map_polylines_center):
        obj_trajs_in = torch.cat((obj_trajs, obj_trajs_mask[:, :, :, None].type_as(obj_trajs)), dim=-1)
        obj_feat = self.agent_polyline_encoder(obj_trajs_in, obj_trajs_mask)
        map_feat = self.map_polyline_encoder(map_polylines, map_polylines_mask)
        obj_valid_mask = (obj_trajs_mask.sum(dim=-1) > 0)
        map_valid_mask = (map_polylines_mask.sum(dim=-1) > 0)
        global_token_feature = torch.cat((obj_feat, map_feat), dim=1)
        global_token_mask = torch.cat((obj_valid_mask, map_valid_mask), dim=1)
        global_token_pos = torch.cat((obj_trajs_last_pos, map_polylines_center), dim=1)
        out = self.apply_local_attn(global_token_feature, global_token_mask, global_token_pos, K_NEIGHBORS)
        return out, global_token_mask, global_token_feature, global_token_pos


# ---- independent reference: one scene at a time, dense kNN mask ------------------------
def reference_scene(enc, x, pos):
    """x: (n, C) valid tokens of one scene, pos: (n, 3)."""
    n = x.shape[0]
    d = ((pos[:, None, :] - pos[None, :, :]) ** 2).sum(-1)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        order = sorted(range(n), key=lambda j: float(d[i, j]))
        for j in order[:K_NEIGHBORS]:
            allowed[i, j] = True
    pe = gen_sineembed_for_position(pos[None, :, 0:2], hidden_dim=D_MODEL)[0]
    h = x
    for layer in enc.self_attn_layers:
        mha = layer.self_attn
        E, H, Dh = D_MODEL, NHEAD, D_MODEL // NHEAD
        qk_in = h + pe
        q = F.linear(qk_in, mha.in_proj_weight[:E], mha.in_proj_bias[:E]).view(n, H, Dh).transpose(0, 1)
        k = F.linear(qk_in, mha.in_proj_weight[E:2 * E], mha.in_proj_bias[E:2 * E]).view(n, H, Dh).transpose(0, 1)
        v = F.linear(h, mha.in_proj_weight[2 * E:], mha.in_proj_bias[2 * E:]).view(n, H, Dh).transpose(0, 1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)      # (H, n, Dh)
        a = mha.out_proj(a.transpose(0, 1).reshape(n, E))
        h = layer.norm1(h + a)
        h = layer.norm2(h + layer.linear2(F.relu(layer.linear1(h))))
    return h


def main():
    B, NOBJ, T, NMAP, P = 3, 4, 5, 6, 4
    obj_trajs = torch.randn(B, NOBJ, T, 4)
    obj_trajs_mask = torch.rand(B, NOBJ, T) > 0.3
    map_polylines = torch.randn(B, NMAP, P, 5)
    map_polylines_mask = torch.rand(B, NMAP, P) > 0.2
    # padding: scene 0 has 3 real objects, scene 1 two, scene 2 one object and two polylines
    obj_trajs_mask[0, 3] = False
    obj_trajs_mask[1, 2:] = False
    obj_trajs_mask[2, 1:] = False
    obj_trajs_mask[:, 0, -1] = True  # the centre object is always valid
    map_polylines_mask[1, 4:] = False
    map_polylines_mask[2, 2:] = False
    map_polylines_mask[2, :2, 0] = True
    obj_trajs = obj_trajs * obj_trajs_mask[..., None]
    map_polylines = map_polylines * map_polylines_mask[..., None]
    obj_trajs_last_pos = torch.randn(B, NOBJ, 3) * 3
    map_polylines_center = torch.randn(B, NMAP, 3) * 3

    enc = MTREncoder().eval()
    with torch.no_grad():
        out, tok_mask, tok_feat, tok_pos = enc(obj_trajs, obj_trajs_mask, map_polylines, map_polylines_mask,
                                               obj_trajs_last_pos, map_polylines_center)
        ok = True
        for b in range(B):
            m = tok_mask[b]
            ref = reference_scene(enc, tok_feat[b][m], tok_pos[b][m])
            ok &= torch.allclose(out[b][m], ref, atol=1e-5, rtol=1e-4)
            ok &= bool((out[b][~m] == 0).all())
            print(f"scene {b}: {int(m.sum())} valid tokens of {m.numel()}, "
                  f"max |diff| {float((out[b][m] - ref).abs().max()):.2e}")
        ok &= bool(torch.isfinite(out).all())
    print("scene 2 has", int(tok_mask[2].sum()), "tokens < K =", K_NEIGHBORS, "-> -1 index pairs masked")
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
