"""Moirai fine-tuning validation: the prediction mask's length was counted in pad steps, not patches.

Citation: SalesforceAIResearch/uni2ts#49 (fixes #29), commit 70e78c0
"fix MoiraiFinetune validation transforms mask_length argument"
(src/uni2ts/model/moirai/finetune.py, ``MoiraiFinetune.val_transform_map``).

The bug: the validation transform chain ends with
``EvalMaskedPrediction(mask_length=-prediction_length % patch_size, ...)``, the expression also used
for ``EvalPad(prediction_pad=...)``: the number of pad *steps* that fill the last prediction patch.
``EvalMaskedPrediction`` sets ``prediction_mask[:, -mask_length:] = True`` over *patches* (the
target is already patchified), so the patches hidden behind ``mask_encoding`` and scored by the
validation loss are not the forecast horizon's (and are all of them when the horizon divides the
patch size, since ``-0:`` is the whole axis).

The fix: ``mask_length=math.ceil(prediction_length / patch_size)``.

Kept from uni2ts: the val transform order (EvalCrop, PackFields, EvalPad, AddObservedMask,
ImputeTimeSeries, Patchify, AddVariateIndex, AddTimeIndex, EvalMaskedPrediction), the
``MoiraiModule.forward`` (PackedStdScaler over ``observed_mask * ~prediction_mask``, in_proj,
``mask_fill`` with ``mask_encoding``, encoder with ``packed_attention_mask(sample_id)``, rotary
over ``time_id``, binary variate bias), and a packed NLL over ``prediction_mask * observed_mask``.
Toy sizes, random weights, a Normal head instead of the mixture, no lightning, no einops.
"""

import math
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- uni2ts.transform (trimmed)


@dataclass
class EvalCrop:
    offset: int
    distance: int
    prediction_length: int
    context_length: int
    fields: tuple

    def __call__(self, data_entry):
        a = self.offset  # window index 0 of the validation split
        b = a + self.context_length + self.prediction_length
        for f in self.fields:
            data_entry[f] = [arr[..., a:b] for arr in data_entry[f]]
        return data_entry


@dataclass
class PackFields:
    output_field: str
    fields: tuple

    def __call__(self, data_entry):
        data_entry[self.output_field] = np.concatenate(
            [a for f in self.fields for a in data_entry[f]], axis=0
        )
        return data_entry


@dataclass
class EvalPad:
    prediction_pad: int
    context_pad: int
    fields: tuple

    def __call__(self, data_entry):
        for f in self.fields:
            arr = data_entry[f]
            data_entry[f] = np.pad(
                arr,
                [(0, 0), (self.context_pad, self.prediction_pad)],
                constant_values=np.nan,
            )
        return data_entry


@dataclass
class AddObservedMask:
    fields: tuple
    observed_mask_field: str = "observed_mask"

    def __call__(self, data_entry):
        data_entry[self.observed_mask_field] = {
            f: ~np.isnan(data_entry[f]) for f in self.fields
        }
        return data_entry


@dataclass
class ImputeTimeSeries:
    fields: tuple
    value: float = 0.0

    def __call__(self, data_entry):
        for f in self.fields:
            arr = data_entry[f].copy()
            arr[np.isnan(arr)] = self.value
            data_entry[f] = arr
        return data_entry


@dataclass
class Patchify:
    max_patch_size: int
    fields: tuple

    def _patchify(self, arr, patch_size):
        var, time = arr.shape
        arr = arr.reshape(var, time // patch_size, patch_size)
        pad = np.zeros((var, time // patch_size, self.max_patch_size - patch_size), arr.dtype)
        return np.concatenate([arr, pad], axis=-1)

    def __call__(self, data_entry):
        ps = data_entry["patch_size"]
        for f in self.fields:
            v = data_entry[f]
            if isinstance(v, dict):
                data_entry[f] = {k: self._patchify(a, ps) for k, a in v.items()}
            else:
                data_entry[f] = self._patchify(v, ps)
        return data_entry


@dataclass
class AddVariateIndex:
    fields: tuple
    variate_id_field: str = "variate_id"

    def __call__(self, data_entry):
        var, time = data_entry["target"].shape[:2]
        data_entry[self.variate_id_field] = {
            "target": np.repeat(np.arange(var)[:, None], time, axis=1)
        }
        return data_entry


@dataclass
class AddTimeIndex:
    fields: tuple
    time_id_field: str = "time_id"

    def __call__(self, data_entry):
        var, time = data_entry["target"].shape[:2]
        data_entry[self.time_id_field] = {
            "target": np.repeat(np.arange(time)[None], var, axis=0)
        }
        return data_entry


@dataclass
class EvalMaskedPrediction:
    mask_length: int
    target_field: str = "target"
    truncate_fields: tuple = tuple()
    optional_truncate_fields: tuple = tuple()
    prediction_mask_field: str = "prediction_mask"
    expected_ndim: int = 2

    def __call__(self, data_entry):
        target = data_entry[self.target_field]
        prediction_mask = self._generate_prediction_mask(target)
        for field in self.truncate_fields:
            arr = data_entry[field]
            if isinstance(arr, dict):
                for k, v in arr.items():
                    if k in self.truncate_fields or k in self.optional_truncate_fields:
                        arr[k] = v[:, ~prediction_mask[0]]
        data_entry[self.prediction_mask_field] = prediction_mask
        return data_entry

    def _generate_prediction_mask(self, target):
        var, time = target.shape[:2]
        prediction_mask = np.zeros((var, time), dtype=bool)
        prediction_mask[:, -self.mask_length :] = True
        return prediction_mask


def flat_pack(data_entry):
    """FlatPackCollection / FlatPackFields: (var, time, ...) -> (var * time, ...)."""
    out = {}
    out["target"] = data_entry["target"].reshape(-1, data_entry["target"].shape[-1])
    out["observed_mask"] = data_entry["observed_mask"]["target"].reshape(
        -1, data_entry["target"].shape[-1]
    )
    out["time_id"] = data_entry["time_id"]["target"].reshape(-1)
    out["variate_id"] = data_entry["variate_id"]["target"].reshape(-1)
    out["prediction_mask"] = data_entry["prediction_mask"].reshape(-1)
    out["patch_size"] = np.full(out["time_id"].shape, data_entry["patch_size"])
    return out


# ---------------------------------------------------------------- MoiraiFinetune.val_transform_map


class MoiraiFinetuneCfg:
    patch_sizes = (8, 16)
    max_dim = 4


def val_transform_map(offset, distance, prediction_length, context_length, patch_size):
    steps = [
        EvalCrop(offset, distance, prediction_length, context_length, fields=("target",)),
        PackFields(output_field="target", fields=("target",)),
        EvalPad(
            prediction_pad=-prediction_length % patch_size,
            context_pad=-context_length % patch_size,
            fields=("target",),
        ),
        AddObservedMask(fields=("target",), observed_mask_field="observed_mask"),
        ImputeTimeSeries(fields=("target",)),
        Patchify(max_patch_size=max(MoiraiFinetuneCfg.patch_sizes), fields=("target", "observed_mask")),
        AddVariateIndex(fields=("target",)),
        AddTimeIndex(fields=("target",)),
        EvalMaskedPrediction(
            mask_length=(
                math.ceil(prediction_length / patch_size)
                if FIXED
                else -prediction_length % patch_size
            ),
            target_field="target",
            truncate_fields=("variate_id", "time_id", "observed_mask"),
            optional_truncate_fields=("past_feat_dynamic_real",),
            prediction_mask_field="prediction_mask",
            expected_ndim=3,
        ),
    ]

    def transform(entry):
        entry = dict(entry)
        entry["patch_size"] = patch_size  # GetPatchSize with FixedPatchSizeConstraints
        for s in steps:
            entry = s(entry)
        return flat_pack(entry)

    return transform


# ---------------------------------------------------------------- uni2ts.common.torch_util / modules


def packed_attention_mask(sample_id):
    sample_id = sample_id.unsqueeze(-1)
    attention_mask = sample_id.eq(sample_id.mT)
    return attention_mask


def mask_fill(tensor, mask, value):
    mask = mask.unsqueeze(-1)
    return tensor * ~mask + value * mask


def safe_div(numer, denom):
    return numer / torch.where(denom == 0, 1.0, denom)


class PackedStdScaler(nn.Module):
    def __init__(self, correction=1, minimum_scale=1e-5):
        super().__init__()
        self.correction = correction
        self.minimum_scale = minimum_scale

    def forward(self, target, observed_mask, sample_id, variate_id):
        id_mask = torch.logical_and(
            torch.eq(sample_id.unsqueeze(-1), sample_id.unsqueeze(-2)),
            torch.eq(variate_id.unsqueeze(-1), variate_id.unsqueeze(-2)),
        )
        tobs = (id_mask * observed_mask.sum(-1).unsqueeze(-2)).sum(-1, keepdim=True)
        loc = (id_mask * (target * observed_mask).sum(-1).unsqueeze(-2)).sum(-1, keepdim=True)
        loc = safe_div(loc, tobs)
        var = (
            id_mask * (((target - loc) ** 2) * observed_mask).sum(-1).unsqueeze(-2)
        ).sum(-1, keepdim=True)
        var = safe_div(var, (tobs - self.correction))
        scale = torch.sqrt(var + self.minimum_scale)
        loc[sample_id == 0] = 0
        scale[sample_id == 0] = 1
        return loc, scale


class MultiInSizeLinear(nn.Module):
    def __init__(self, in_features_ls, out_features):
        super().__init__()
        self.in_features_ls = in_features_ls
        self.weight = nn.Parameter(torch.randn(len(in_features_ls), out_features, max(in_features_ls)) * 0.2)
        self.bias = nn.Parameter(torch.zeros(len(in_features_ls), out_features))
        mask = torch.zeros(len(in_features_ls), 1, max(in_features_ls))
        for i, f in enumerate(in_features_ls):
            mask[i, :, :f] = 1
        self.register_buffer("mask", mask)

    def forward(self, x, in_feat_size):
        out = 0
        for idx, feat_size in enumerate(self.in_features_ls):
            weight = self.weight[idx] * self.mask[idx]
            out = out + torch.eq(in_feat_size, feat_size).unsqueeze(-1) * (x @ weight.T + self.bias[idx])
        return out


class RotaryProjection(nn.Module):
    def __init__(self, proj_width, max_len=512, base=10000):
        super().__init__()
        theta = 1.0 / base ** (torch.arange(0, proj_width, 2).float() / proj_width)
        pos = torch.arange(max_len).float()
        m_theta = torch.einsum("n,d->nd", pos, theta).repeat_interleave(2, dim=-1)
        self.register_buffer("cos", m_theta.cos(), persistent=False)
        self.register_buffer("sin", m_theta.sin(), persistent=False)

    @staticmethod
    def _rotate(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([-x2, x1], dim=-1).flatten(-2)

    def forward(self, x, seq_id):
        return self.cos[seq_id] * x + self.sin[seq_id] * self._rotate(x)


class GroupedQueryAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.out_proj = nn.Linear(dim, dim, bias=False)
        self.q_norm = nn.LayerNorm(self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim)
        # BinaryAttentionBias
        self.var_emb = nn.Embedding(2, num_heads)
        # QueryKeyProjection with partial_factor (0.0, 0.5): rotary on the first half of each head
        self.rot_dim = self.head_dim // 2
        self.time_qk_proj = RotaryProjection(self.rot_dim)

    def _rope(self, x, time_id):
        t = time_id.unsqueeze(1)
        rot, rest = x[..., : self.rot_dim], x[..., self.rot_dim :]
        return torch.cat([self.time_qk_proj(rot, t), rest], dim=-1)

    def forward(self, x, attn_mask, time_id, var_id):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rope(q, time_id), self._rope(k, time_id)
        ind = torch.eq(var_id.unsqueeze(-1), var_id.unsqueeze(-2)).long()
        bias = self.var_emb(ind).permute(0, 3, 1, 2)  # (b, h, n, n)
        attn_bias = torch.where(attn_mask.unsqueeze(1), bias, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class EncoderLayer(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.self_attn = GroupedQueryAttention(dim, num_heads)
        self.norm1 = nn.RMSNorm(dim)
        self.norm2 = nn.RMSNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, attn_mask, time_id, var_id):
        x = x + self.self_attn(self.norm1(x), attn_mask, time_id, var_id)
        return x + self.ffn(self.norm2(x))


class TransformerEncoder(nn.Module):
    def __init__(self, dim, num_layers, num_heads):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(dim, num_heads) for _ in range(num_layers))
        self.norm = nn.RMSNorm(dim)

    def forward(self, x, attn_mask, time_id, var_id):
        for layer in self.layers:
            x = layer(x, attn_mask, time_id, var_id)
        return self.norm(x)


class MoiraiModule(nn.Module):
    def __init__(self, d_model=32, num_layers=2, patch_sizes=(8, 16)):
        super().__init__()
        self.patch_sizes = patch_sizes
        self.max_patch = max(patch_sizes)
        self.mask_encoding = nn.Embedding(1, d_model)
        self.scaler = PackedStdScaler()
        self.in_proj = MultiInSizeLinear(patch_sizes, d_model)
        self.encoder = TransformerEncoder(d_model, num_layers, num_heads=4)
        # Normal head in place of the mixture: loc and log-scale per step of the patch
        self.param_proj = nn.Linear(d_model, 2 * self.max_patch)

    def forward(self, target, observed_mask, sample_id, time_id, variate_id, prediction_mask, patch_size):
        loc, scale = self.scaler(
            target,
            observed_mask * ~prediction_mask.unsqueeze(-1),
            sample_id,
            variate_id,
        )
        scaled_target = (target - loc) / scale
        reprs = self.in_proj(scaled_target, patch_size)
        masked_reprs = mask_fill(reprs, prediction_mask, self.mask_encoding.weight)
        reprs = self.encoder(
            masked_reprs,
            packed_attention_mask(sample_id),
            time_id=time_id,
            var_id=variate_id,
        )
        mu, log_sigma = self.param_proj(reprs).chunk(2, dim=-1)
        return torch.distributions.Normal(mu * scale + loc, F.softplus(log_sigma) * scale + 1e-3)


def packed_nll_loss(distr, target, prediction_mask, observed_mask, sample_id, variate_id):
    """PackedNLLLoss with the default per-(sample, variate) reduction of PackedPointLoss."""
    loss = -distr.log_prob(target)
    mask = prediction_mask.unsqueeze(-1) * observed_mask
    loss = loss * mask
    id_mask = torch.logical_and(
        torch.eq(sample_id.unsqueeze(-1), sample_id.unsqueeze(-2)),
        torch.eq(variate_id.unsqueeze(-1), variate_id.unsqueeze(-2)),
    )
    tobs = (id_mask * mask.sum(-1).unsqueeze(-2)).sum(-1, keepdim=True)
    nobs = (
        torch.eq(sample_id.unsqueeze(-1), sample_id.unsqueeze(-2)) * prediction_mask.unsqueeze(-2)
    ).sum(-1, keepdim=True) * prediction_mask.unsqueeze(-1)
    nobs = torch.where(nobs == 0, nobs, 1 / nobs).sum()
    loss = safe_div(loss, tobs * nobs)
    return (loss * (sample_id != 0).unsqueeze(-1)).sum()


def pad_collate(entries):
    n = max(e["target"].shape[0] for e in entries)
    out = {}
    for k in entries[0]:
        arrs = []
        for e in entries:
            a = torch.as_tensor(e[k])
            pad = [0, 0] * (a.dim() - 1) + [0, n - a.shape[0]]
            arrs.append(F.pad(a, pad))
        out[k] = torch.stack(arrs)
    out["sample_id"] = torch.stack(
        [F.pad(torch.ones(e["target"].shape[0], dtype=torch.long), [0, n - e["target"].shape[0]]) for e in entries]
    )
    return out


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    prediction_length, context_length, patch_size = 24, 128, 16

    t = np.arange(200, dtype=np.float64)
    series = [
        np.sin(t / 6.0) * 3 + 10 + rng.normal(0, 0.3, t.shape),
        np.cos(t / 9.0) * 5 - 2 + rng.normal(0, 0.5, t.shape),
    ]
    series[1][40:47] = np.nan  # a gap in the context

    transform = val_transform_map(0, 1, prediction_length, context_length, patch_size)
    entries = [transform({"target": [s[None]]}) for s in series]
    batch = pad_collate(entries)
    batch["target"] = batch["target"].float()

    model = MoiraiModule(patch_sizes=MoiraiFinetuneCfg.patch_sizes).eval()
    with torch.no_grad():
        distr = model(
            batch["target"],
            batch["observed_mask"],
            batch["sample_id"],
            batch["time_id"],
            batch["variate_id"],
            batch["prediction_mask"],
            batch["patch_size"],
        )
        val_loss = packed_nll_loss(
            distr,
            batch["target"],
            batch["prediction_mask"],
            batch["observed_mask"],
            batch["sample_id"],
            batch["variate_id"],
        )
        horizon = math.ceil(prediction_length / patch_size)
        forecast = distr.mean[0, -horizon:, :patch_size].flatten()[:prediction_length]
    print("prediction_mask[0]:", batch["prediction_mask"][0].int().tolist())
    print("val/PackedNLLLoss:", round(val_loss.item(), 5))
    print("horizon forecast mean, sample 0 (first 6):", [round(x, 3) for x in forecast[:6].tolist()])


if __name__ == "__main__":
    main()
