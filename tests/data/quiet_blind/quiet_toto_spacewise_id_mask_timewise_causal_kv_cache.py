"""Toto (DataDog/toto) time-series foundation model backbone, shrunk, SDPA path (no xFormers).

Ported from toto/model/attention.py (BaseMultiheadAttention.rearrange_inputs / get_qkv /
positional_embedding / run_attention / rearrange_output, TimeWise / SpaceWise subclasses),
toto/model/transformer.py (TransformerLayer, Transformer._get_mask, _get_layer_types,
forward), toto/model/util.py (make_batched_block_mask, KVCache for the non-memory-efficient
layout), toto/model/embedding.py (PatchEmbedding with its id_mask reduction),
toto/model/backbone.py (the kv-cache input slicing) and toto/inference/forecaster.py
(generate_mean's patch-by-patch loop with dummy_id_mask).  einops.rearrange calls are
written as reshape/permute; the rotary embedding is a plain-torch stand-in with the same
seq_pos_offset handling; the scaler and the distribution head are replaced by a linear
head (mask-irrelevant).

Masking:
  * time-wise layers get attention_mask=None: SDPA with is_causal=True on the prefill
    (seq_pos_offset == 0, square), and is_causal=False on cached decode steps, where the
    only query is the newest patch and every cached key is in its past.
  * space-wise layers get a bool mask (True = attend) built per time step from id_mask:
    make_batched_block_mask(id_mask^T) -> variates attend only variates with the same id
    (several independent multivariate series packed in one batch row); each variate always
    sees itself, so no row is empty.

Checks: (1) every hidden state against a loop reference (time: softmax over keys 0..t of
the same variate; space: softmax over same-id variates at the same step); (2) cached
patch-by-patch forecasting equals the no-cache forecasting; (3) each id group run alone as
its own batch row gives the same forecast.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

TIME, SPACE = 1, 2


def make_batched_block_mask(t):
    unsqueezed = t.unsqueeze(-2)  # "... d -> ... 1 d"
    return unsqueezed == unsqueezed.transpose(-1, -2)


class RotaryStandIn(nn.Module):
    def __init__(self, head_dim, base=10000.0):
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv", inv)

    def _rot(self, x, offset):
        L = x.shape[-2]
        pos = torch.arange(offset, offset + L, dtype=torch.float32)
        ang = pos[:, None] * self.inv[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1)
        sin = torch.cat([ang.sin(), ang.sin()], -1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def rotate_queries_and_keys(self, q, k, seq_pos_offset=0):
        return self._rot(q, seq_pos_offset), self._rot(k, seq_pos_offset)


class BaseMultiheadAttention(nn.Module):
    attention_axis = None

    def __init__(self, embed_dim, num_heads, dropout, rotary_emb):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.rotary_emb = rotary_emb
        self.wQKV = nn.Linear(embed_dim, embed_dim * 3)
        self.dropout = dropout
        self.wO = nn.Linear(embed_dim, embed_dim)

    def rearrange_inputs(self, inputs):
        b, v, s, e = inputs.shape
        if self.attention_axis == TIME:   # (batch variate) seq_len embed_dim
            return inputs.reshape(b * v, s, e)
        return inputs.permute(0, 2, 1, 3).reshape(b * s, v, e)  # (batch seq_len) variate embed_dim

    def get_qkv(self, inputs):
        # "... L (qkv head_dim n_heads) -> qkv ... n_heads L head_dim"
        n, L, _ = inputs.shape
        qkv = self.wQKV(inputs.contiguous()).view(n, L, 3, self.head_dim, self.num_heads)
        return qkv.permute(2, 0, 4, 1, 3).unbind(dim=0)

    def positional_embedding(self, q, k, v, kv_cache, layer_idx):
        seq_pos_offset = 0
        if self.rotary_emb is not None and self.attention_axis == TIME:
            if kv_cache is not None:
                seq_pos_offset = kv_cache.seq_len(layer_idx)
            q, k = self.rotary_emb.rotate_queries_and_keys(q, k, seq_pos_offset=seq_pos_offset)
        if kv_cache is not None and self.attention_axis == TIME:
            kv_cache.append(layer_idx, (k, v))
            k, v = kv_cache[layer_idx]
        return q.contiguous(), k.contiguous().to(q.dtype), v.contiguous().to(q.dtype), seq_pos_offset

    def rearrange_output(self, output, batch, variate, seq_len):
        # output: (N, n_heads, L, head_dim) -> batch variate seq_len (n_heads head_dim)
        N, H, L, D = output.shape
        o = output.permute(0, 2, 1, 3).reshape(N, L, H * D)
        if self.attention_axis == TIME:
            return o.view(batch, variate, seq_len, H * D)
        return o.view(batch, seq_len, variate, H * D).permute(0, 2, 1, 3)

    def run_attention(self, attention_mask, q, k, v, seq_pos_offset, dropout, seq_len, variate):
        q_dim_start, q_dim_end = seq_pos_offset, seq_pos_offset + seq_len
        kv_dim_start, kv_dim_end = 0, v.shape[2]
        if self.attention_axis == TIME:
            attention_mask = (
                attention_mask[..., q_dim_start:q_dim_end, kv_dim_start:kv_dim_end]
                if torch.is_tensor(attention_mask) else None
            )
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask, dropout_p=dropout,
                is_causal=(attention_mask is None and seq_pos_offset == 0),
            )
        # We don't use causal masking for space-wise attention
        attention_mask = (
            attention_mask[..., kv_dim_start:kv_dim_end, kv_dim_start:kv_dim_end]
            if torch.is_tensor(attention_mask) else None
        )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=dropout,
                                              is_causal=False)

    def forward(self, layer_idx, inputs, attention_mask=None, kv_cache=None):
        batch_size, variate, seq_len, _ = inputs.shape
        dropout = self.dropout if self.training else 0.0
        q, k, v = self.get_qkv(self.rearrange_inputs(inputs))
        q, k, v, seq_pos_offset = self.positional_embedding(q, k, v, kv_cache, layer_idx)
        output = self.run_attention(attention_mask, q, k, v, seq_pos_offset, dropout, seq_len, variate)
        return self.wO(self.rearrange_output(output, batch_size, variate, seq_len))


class TimeWiseMultiheadAttention(BaseMultiheadAttention):
    attention_axis = TIME


class SpaceWiseMultiheadAttention(BaseMultiheadAttention):
    attention_axis = SPACE


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


class TransformerLayer(nn.Module):
    def __init__(self, embed_dim, num_heads, mlp_hidden, dropout, rotary_emb, attention_axis):
        super().__init__()
        self.num_heads = num_heads
        self.attention_axis = attention_axis
        cls = TimeWiseMultiheadAttention if attention_axis == TIME else SpaceWiseMultiheadAttention
        self.attention = cls(embed_dim, num_heads, dropout, rotary_emb)
        self.norm1 = RMSNorm(embed_dim)
        self.norm2 = RMSNorm(embed_dim)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, mlp_hidden), nn.GELU(), nn.Linear(mlp_hidden, embed_dim))

    def forward(self, layer_idx, inputs, attention_mask=None, kv_cache=None):
        pre_norm_1 = self.norm1(inputs)
        hidden_state = inputs + self.attention(layer_idx, pre_norm_1, attention_mask, kv_cache).contiguous()
        return hidden_state + self.mlp(self.norm2(hidden_state))


class KVCache:
    """Non-memory-efficient layout: (time_layer_count, batch*variates, heads, max_seq_len, head_dim)."""

    def __init__(self, batch_size, num_variates, transformer_layers, num_heads, embed_dim, max_seq_len):
        self.batch_size, self.num_variates = batch_size, num_variates
        time_layer_indices = [i for i, l in enumerate(transformer_layers)
                              if isinstance(l.attention, TimeWiseMultiheadAttention)]
        n = max(1, len(time_layer_indices))
        shape = (n, batch_size * num_variates, num_heads, max_seq_len, embed_dim // num_heads)
        self.max_seq_len = max_seq_len
        self._keys = torch.zeros(shape)
        self._values = torch.zeros_like(self._keys)
        self._current_idx = torch.zeros(n, dtype=torch.int)
        self._layer_cache_map = torch.zeros((len(transformer_layers),), dtype=torch.int)
        for cache_idx, layer_idx in enumerate(time_layer_indices):
            self._layer_cache_map[layer_idx] = int(cache_idx)

    def __getitem__(self, layer_idx):
        cache_idx = int(self._layer_cache_map[layer_idx].item())
        end_idx = int(self._current_idx[cache_idx].item())
        return self._keys[cache_idx, :, :, :end_idx, :], self._values[cache_idx, :, :, :end_idx, :]

    def current_len(self, cache_idx):
        return int(self._current_idx[cache_idx].item())

    def seq_len(self, layer_idx):
        return self.current_len(int(self._layer_cache_map[layer_idx].item()))

    def append(self, layer_idx, kv):
        cache_idx = int(self._layer_cache_map[layer_idx].item())
        keys, values = kv
        assert keys.shape[0] == self.batch_size * self.num_variates
        start_idx = self._current_idx[cache_idx]
        end_idx = start_idx + keys.shape[2]
        assert end_idx <= self.max_seq_len
        self._keys[cache_idx, :, :, start_idx:end_idx, :] = keys
        self._values[cache_idx, :, :, start_idx:end_idx, :] = values
        self._current_idx[cache_idx] = end_idx


class Transformer(nn.Module):
    def __init__(self, num_layers, embed_dim, num_heads, mlp_hidden, dropout,
                 spacewise_every_n_layers, spacewise_first):
        super().__init__()
        self.rotary_emb = RotaryStandIn(embed_dim // num_heads)
        axes = self._get_layer_types(num_layers, spacewise_every_n_layers, spacewise_first)
        self.layers = nn.ModuleList([
            TransformerLayer(embed_dim, num_heads, mlp_hidden, dropout, self.rotary_emb, axes[i])
            for i in range(num_layers)])

    def _get_mask(self, num_heads, dtype, id_mask=None):
        if id_mask is None:
            raise ValueError("id_mask must be provided for spacewise masks.")
        mask = make_batched_block_mask(id_mask.transpose(-1, -2))  # batch seq_len variate variate
        b, s, v1, v2 = mask.shape
        mask = mask.reshape(b * s, 1, v1, v2)  # (batch seq_len) 1 variate1 variate2
        return mask.expand(-1, num_heads, -1, -1).contiguous()

    def _get_layer_types(self, num_layers, spacewise_every_n_layers, spacewise_first):
        if spacewise_every_n_layers == -1:
            return [TIME] * num_layers
        assert num_layers % spacewise_every_n_layers == 0
        block = [TIME] * (spacewise_every_n_layers - 1)
        block = [SPACE] + block if spacewise_first else block + [SPACE]
        return block * (num_layers // spacewise_every_n_layers)

    def forward(self, inputs, id_mask, kv_cache=None, trace=None):
        batch, _, seq_len, _ = inputs.shape
        seq_len = (kv_cache.seq_len(1) if kv_cache else 0) + seq_len
        num_heads = self.layers[0].num_heads
        timewise_attention_mask = None
        spacewise_attention_mask = self._get_mask(num_heads=num_heads, dtype=inputs.dtype, id_mask=id_mask)
        for layer_idx, layer in enumerate(self.layers):
            if trace is not None:
                trace.append(inputs)
            inputs = layer(layer_idx, inputs,
                           timewise_attention_mask if layer.attention_axis == TIME else spacewise_attention_mask,
                           kv_cache)
        if trace is not None:
            trace.append(inputs)
        return inputs


class PatchEmbedding(nn.Module):
    def __init__(self, patch_size, stride, embed_dim):
        super().__init__()
        self.patch_size, self.stride = patch_size, stride
        self.projection = nn.Linear(patch_size, embed_dim)

    def _patchify(self, x):
        return x.unfold(dimension=-1, size=self.patch_size, step=self.stride)

    def forward(self, x, id_mask):
        x_patched = self._patchify(x)
        id_mask_patched = self._patchify(id_mask)
        assert torch.eq(id_mask_patched.min(-1).values, id_mask_patched.max(-1).values).all(), \
            "Patches cannot span multiple datasets"
        return self.projection(x_patched), id_mask_patched.min(-1).values


class Backbone(nn.Module):
    def __init__(self, patch=2, embed_dim=16, num_heads=2, num_layers=4):
        super().__init__()
        self.patch_embed = PatchEmbedding(patch, patch, embed_dim)
        self.transformer = Transformer(num_layers, embed_dim, num_heads, 32, 0.0,
                                       spacewise_every_n_layers=2, spacewise_first=True)
        self.head = nn.Linear(embed_dim, patch)  # stand-in for the distribution mean
        self.embed_dim, self.num_heads = embed_dim, num_heads

    def allocate_kv_cache(self, batch_size, num_variates, max_time_steps):
        return KVCache(batch_size, num_variates, list(self.transformer.layers), self.num_heads,
                       self.embed_dim, max_seq_len=-(-max_time_steps // self.patch_embed.stride))

    def forward(self, inputs, id_mask, kv_cache=None, trace=None):
        if kv_cache is not None:
            kv_cache_len = kv_cache.current_len(0)
            prefix_len = max(0, self.patch_embed.stride * kv_cache_len)
            inputs = inputs[:, :, prefix_len:]
            id_mask = id_mask[:, :, prefix_len:]
        embeddings, reduced_id_mask = self.patch_embed(inputs, id_mask)
        h = self.transformer(embeddings, reduced_id_mask, kv_cache, trace)
        return self.head(h).flatten(-2)  # batch variate time_steps


@torch.no_grad()
def generate_mean(model, inputs, id_mask, prediction_length, use_kv_cache):
    patch_size = model.patch_embed.stride
    rounded_steps = -(-prediction_length // patch_size) * patch_size
    start_index = inputs.shape[-1]
    dummy_id_mask = id_mask[:, :, -1:].repeat(1, 1, patch_size)
    kv_cache = (model.allocate_kv_cache(inputs.shape[0], inputs.shape[1], inputs.shape[2] + rounded_steps)
                if use_kv_cache else None)
    for _ in range(rounded_steps // patch_size):
        mean = model(inputs, id_mask, kv_cache)
        samples = mean[:, :, -patch_size:]
        inputs = torch.cat([inputs, samples], dim=-1)
        id_mask = torch.cat([id_mask, dummy_id_mask], dim=-1)
    return inputs[:, :, start_index:start_index + prediction_length]


def loop_layer(layer, x, ids):
    """Reference for one TransformerLayer: x (B, V, S, E), ids (B, V, S)."""
    att = layer.attention
    B, V, S, E = x.shape
    H, D = att.num_heads, att.head_dim
    h = layer.norm1(x)
    qkv = att.wQKV(h).view(B, V, S, 3, D, H)
    q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]  # B V S D H
    q = q.permute(0, 1, 4, 2, 3)  # B V H S D
    k = k.permute(0, 1, 4, 2, 3)
    v = v.permute(0, 1, 4, 2, 3)
    if layer.attention_axis == TIME:
        q, k = att.rotary_emb.rotate_queries_and_keys(q, k, 0)
    out = torch.zeros(B, V, S, H, D)
    for b in range(B):
        for vi in range(V):
            for t in range(S):
                if layer.attention_axis == TIME:
                    keys = [(vi, s) for s in range(t + 1)]
                else:
                    keys = [(u, t) for u in range(V) if ids[b, u, t] == ids[b, vi, t]]
                for hh in range(H):
                    sc = torch.stack([q[b, vi, hh, t] @ k[b, u, hh, s] for u, s in keys]) / D ** 0.5
                    p = torch.softmax(sc, 0)
                    out[b, vi, t, hh] = sum(p[n] * v[b, u, hh, s] for n, (u, s) in enumerate(keys))
    y = x + att.wO(out.reshape(B, V, S, H * D))
    return y + layer.mlp(layer.norm2(y))


def main():
    model = Backbone().eval()
    B, V, T, P = 2, 5, 8, 6
    series = torch.randn(B, V, T)
    # row 0 packs two series (3 variates + 2 variates), row 1 packs three (1 + 2 + 2)
    id_mask = torch.tensor([[0, 0, 0, 1, 1], [4, 7, 7, 9, 9]]).unsqueeze(-1).repeat(1, 1, T)

    with torch.no_grad():
        # (1) loop reference on every layer of a full forward
        trace = []
        model(series, id_mask, None, trace)
        ids_p = id_mask[:, :, ::2]
        worst = 0.0
        for li, layer in enumerate(model.transformer.layers):
            ref = loop_layer(layer, trace[li], ids_p)
            worst = max(worst, (ref - trace[li + 1]).abs().max().item())
        ok1 = worst < 1e-5
        print("layer axes:", ["TIME" if l.attention_axis == TIME else "SPACE" for l in model.transformer.layers])
        print("(1) loop reference max diff: %.2e match: %s" % (worst, ok1))

        # (2) cached patch-by-patch forecast == recompute-everything forecast
        f_cache = generate_mean(model, series, id_mask, P, use_kv_cache=True)
        f_full = generate_mean(model, series, id_mask, P, use_kv_cache=False)
        d2 = (f_cache - f_full).abs().max().item()
        ok2 = d2 < 1e-5
        print("(2) kv-cache forecast vs no-cache max diff: %.2e match: %s" % (d2, ok2))

        # (3) each id group alone as its own batch row
        d3 = 0.0
        for b in range(B):
            for g in id_mask[b, :, 0].unique():
                sel = (id_mask[b, :, 0] == g).nonzero().flatten()
                alone = generate_mean(model, series[b:b + 1, sel], id_mask[b:b + 1, sel], P, use_kv_cache=True)
                d3 = max(d3, (alone[0] - f_cache[b, sel]).abs().max().item())
        ok3 = d3 < 1e-5
        print("(3) groups run alone vs packed max diff: %.2e match: %s" % (d3, ok3))

    ok = ok1 and ok2 and ok3
    print("MATCH" if ok else "MISMATCH")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
