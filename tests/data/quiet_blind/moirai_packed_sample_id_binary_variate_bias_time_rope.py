"""Moirai (uni2ts) any-variate attention on a packed batch: sample_id mask, variate bias, RoPE over time_id.

Follows SalesforceAIResearch/uni2ts src/uni2ts/module/attention.py (GroupedQueryAttention._update_attn_mask:
the bias from var_attn_bias, then masked_fill(~attn_mask, -inf), passed as attn_mask to SDPA),
src/uni2ts/module/position/attn_bias.py (BinaryAttentionBias: one learned value per head for same / different
variate_id), src/uni2ts/module/transformer.py (packed_attention_mask: sample_id == sample_id) and
src/uni2ts/model/moirai/module.py (prediction_mask patches replaced by mask_encoding; recalled).  Every row packs
several multivariate series, each flattened variate-major into patches; trailing padding has sample_id 0.
Attention is bidirectional within one sample (all its variates and time steps, including the masked forecast
patches, which are what the model must fill in) and blocked across samples.  Padding tokens form their own
block and are never read.  Checked: each sample alone, unpacked, gives the same outputs.
"""
import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F


def packed_attention_mask(sample_id):
    return torch.eq(sample_id.unsqueeze(-1), sample_id.unsqueeze(-2))


class BinaryAttentionBias(nn.Module):
    def __init__(self, num_heads):
        super().__init__()
        self.emb = nn.Embedding(num_embeddings=2, embedding_dim=num_heads)

    def forward(self, query_id, kv_id):
        ind = torch.eq(query_id.unsqueeze(-1), kv_id.unsqueeze(-2)).unsqueeze(1)  # [b, 1, q, kv]
        weight = self.emb.weight[:, None, :, None, None]  # [two, 1, heads, 1, 1]
        return ~ind * weight[0] + ind * weight[1]  # [b, heads, q, kv]


class RotaryProjection(nn.Module):
    def __init__(self, head_dim, max_len=64, base=10000):
        super().__init__()
        theta = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        m = torch.arange(max_len)[:, None].float() * theta
        self.register_buffer("cos", torch.cat([m, m], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([m, m], -1).sin(), persistent=False)

    def forward(self, x, seq_id):
        x1, x2 = x.chunk(2, -1)
        rot = torch.cat([-x2, x1], -1)
        return x * self.cos[seq_id][:, None] + rot * self.sin[seq_id][:, None]


class MultiHeadAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))
        self.q_norm, self.k_norm = nn.LayerNorm(self.head_dim), nn.LayerNorm(self.head_dim)
        self.var_attn_bias = BinaryAttentionBias(num_heads)
        self.time_qk_proj = RotaryProjection(self.head_dim)
        self.softmax_scale = 1 / math.sqrt(self.head_dim)

    def forward(self, x, attn_mask, var_id, time_id):
        b, t, _ = x.shape
        split = lambda y: y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        query, key, value = self.q_norm(split(self.q_proj(x))), self.k_norm(split(self.k_proj(x))), split(self.v_proj(x))
        attn_bias = self.var_attn_bias(var_id, var_id)
        attn_mask = attn_bias.masked_fill(attn_mask.unsqueeze(1).logical_not(), float("-inf"))
        query, key = self.time_qk_proj(query, time_id), self.time_qk_proj(key, time_id)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=self.softmax_scale)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class MoiraiModule(nn.Module):
    def __init__(self, d_model=32, num_layers=2, patch_size=8, num_heads=4):
        super().__init__()
        self.patch_size = patch_size
        self.in_proj = nn.Linear(patch_size * 2, d_model)  # values and observed flags
        self.mask_encoding = nn.Embedding(1, d_model)
        norm = partial(nn.RMSNorm, d_model)
        self.layers = nn.ModuleList(MultiHeadAttention(d_model, num_heads) for _ in range(num_layers))
        self.ffns = nn.ModuleList(nn.Sequential(norm(), nn.Linear(d_model, 64), nn.SiLU(), nn.Linear(64, d_model))
                                  for _ in range(num_layers))
        self.norms = nn.ModuleList(norm() for _ in range(num_layers))
        self.out = nn.Linear(d_model, patch_size)

    def forward(self, target, observed_mask, sample_id, time_id, variate_id, prediction_mask):
        # PackedStdScaler in miniature: per (sample, variate) statistics over observed, non-forecast values
        loc = torch.zeros_like(target)
        scale = torch.ones_like(target)
        for b in range(target.size(0)):
            for s, v in set(zip(sample_id[b].tolist(), variate_id[b].tolist())):
                sel = (sample_id[b] == s) & (variate_id[b] == v)
                ctx = sel & ~prediction_mask[b]
                vals = target[b][ctx][observed_mask[b][ctx]]
                if s == 0 or vals.numel() < 2:
                    continue
                loc[b, sel], scale[b, sel] = vals.mean(), vals.std() + 1e-5
        scaled = torch.where(observed_mask, (target - loc) / scale, torch.zeros_like(target))
        reprs = self.in_proj(torch.cat([scaled, observed_mask.float()], -1))
        reprs = torch.where(prediction_mask.unsqueeze(-1), self.mask_encoding.weight, reprs)
        attn_mask = packed_attention_mask(sample_id)
        for attn, ffn, norm in zip(self.layers, self.ffns, self.norms):
            reprs = reprs + attn(norm(reprs), attn_mask, variate_id, time_id)
            reprs = reprs + ffn(reprs)
        return self.out(reprs) * scale + loc


def pack(series_list, patch_size, width):
    """Flatten each [variates, patches, patch_size] series variate-major; pad the row to width with sample_id 0."""
    fields = {k: [] for k in ("target", "observed_mask", "sample_id", "time_id", "variate_id", "prediction_mask")}
    for sid, (x, horizon) in enumerate(series_list, start=1):
        nv, npatch, _ = x.shape
        fields["target"].append(torch.nan_to_num(x).reshape(-1, patch_size))
        fields["observed_mask"].append(~torch.isnan(x).reshape(-1, patch_size))
        fields["sample_id"].append(torch.full((nv * npatch,), sid))
        fields["time_id"].append(torch.arange(npatch).repeat(nv))
        fields["variate_id"].append(torch.arange(nv).repeat_interleave(npatch))
        fields["prediction_mask"].append((torch.arange(npatch) >= npatch - horizon).repeat(nv))
    out = {k: torch.cat(v) for k, v in fields.items()}
    pad = width - out["sample_id"].numel()
    out["target"] = F.pad(out["target"], (0, 0, 0, pad))
    out["observed_mask"] = F.pad(out["observed_mask"], (0, 0, 0, pad))
    for k in ("sample_id", "time_id", "variate_id", "prediction_mask"):
        out[k] = F.pad(out[k], (0, pad))
    return {k: v[None] for k, v in out.items()}


def main():
    torch.manual_seed(0)
    model = MoiraiModule().eval()
    p = model.patch_size
    a = torch.randn(2, 4, p)  # 2 variates, 4 patches, last one to forecast
    a[1, 0, :3] = float("nan")  # missing values inside a context patch
    b = torch.randn(1, 5, p)  # univariate, last 2 patches to forecast
    c = torch.randn(3, 2, p)  # 3 variates, last patch to forecast
    rows = [[(a, 1), (b, 2)], [(c, 1)]]
    width = 16
    packed = [pack(r, p, width) for r in rows]
    batch = {k: torch.cat([x[k] for x in packed]) for k in packed[0]}
    with torch.no_grad():
        preds = model(**batch)
        for r, row in enumerate(rows):
            for sid, item in enumerate(row, start=1):
                alone = pack([item], p, item[0].shape[0] * item[0].shape[1])
                sel = batch["sample_id"][r] == sid
                torch.testing.assert_close(preds[r][sel], model(**alone)[0], rtol=1e-4, atol=1e-4)
    forecast = preds[batch["prediction_mask"] & (batch["sample_id"] > 0)]
    print("forecast patches", tuple(forecast.shape))


if __name__ == "__main__":
    main()
