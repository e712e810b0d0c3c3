"""TimesFM patched decoder: causal attention over patches with a left-padded context and real zero values.

Follows google-research/timesfm src/timesfm/pytorch_patched_decoder.py (TimesFMConfig, convert_paddings_to_mask,
causal_mask, merge_masks, TimesFMAttention, StackedDecoder, _shift_padded_seq, _masked_mean_std).
The mask is the project's additive one: causal over patches, minimum-merged with a padding mask that hides padded
patches as keys AND as queries (merge_masks' expand_t). Padding is given by `paddings` (1 = pad), never by value:
the series is intermittent demand with many real 0.0 values, so whole patches of zeros are real data.
Padded patches are at the FRONT of the context (TimesFM pads short contexts on the left); their rows are fully
masked (softmax of a constant row) and their outputs are never read. Only the last patch's output is used for
the forecast, so a short series padded to the batch's context length forecasts exactly as it does alone.
"""
import dataclasses
import math
from typing import List

import torch
from torch import nn
import torch.nn.functional as F


@dataclasses.dataclass
class TimesFMConfig:
    """Config for initializing timesfm patched_decoder class (a small one)."""
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    hidden_size: int = 32
    intermediate_size: int = 32
    head_dim: int = 8
    rms_norm_eps: float = 1e-6
    patch_len: int = 4
    horizon_len: int = 8
    quantiles: List[float] = dataclasses.field(default_factory=lambda: [0.1, 0.5, 0.9])
    pad_val: float = 1123581321.0
    tolerance: float = 1e-6
    use_positional_embedding: bool = True


def get_large_negative_number(dtype):
    return torch.tensor(-0.7 * torch.finfo(dtype).max, dtype=dtype)


def convert_paddings_to_mask(paddings, dtype=torch.float32):
    """[B, T] paddings (1 = pad) -> [B, 1, 1, T] additive logit mask."""
    attention_mask = paddings.detach().clone()
    attention_mask = attention_mask[:, None, None, :]
    attention_mask *= get_large_negative_number(dtype)
    return attention_mask


def causal_mask(input_t):
    large_negative_number = get_large_negative_number(input_t.dtype)
    t = input_t.shape[1]
    col_idx = torch.arange(t).unsqueeze(0).repeat(t, 1)
    row_idx = torch.arange(t).unsqueeze(1).repeat(1, t)
    mask = (row_idx < col_idx).to(input_t.dtype) * large_negative_number
    return mask.unsqueeze(0).unsqueeze(0)


def merge_masks(a, b):
    def expand_t(key_mask):
        query_mask = key_mask.transpose(-1, -2)
        return torch.minimum(query_mask, key_mask)

    if a.shape[2] != b.shape[2]:
        if a.shape[2] == 1:
            a = expand_t(a)
        else:
            b = expand_t(b)
    return torch.minimum(a, b)


def _shift_padded_seq(mask, seq):
    """Shifts rows of seq so that the first unpadded patch gets position 0."""
    batch_size, num_seq, feature_dim = seq.shape
    new_mask = mask == 0
    indices = new_mask.to(torch.int32).argmax(dim=1)
    indices[~new_mask.any(dim=1)] = -1
    idx_range = torch.arange(num_seq).unsqueeze(0).unsqueeze(-1).expand(batch_size, -1, feature_dim)
    shifted_idx = (idx_range - indices[:, None, None]) % num_seq
    return seq.gather(1, shifted_idx)


def _masked_mean_std(inputs, padding):
    """Mean and std of the first patch with at least 3 unpadded values."""
    pad_sum = torch.sum(1 - padding, dim=2)
    ok = (pad_sum >= 3).to(torch.int32)
    patch_indices = torch.where(ok.sum(dim=1) == 0, inputs.shape[1] - 1, torch.argmax(ok, dim=1))
    bidxs = torch.arange(inputs.shape[0])
    arr = inputs[bidxs, patch_indices, :]
    mask = 1 - padding[bidxs, patch_indices, :]
    n = torch.clamp(mask.sum(dim=1), min=1)
    mean = (arr * mask).sum(dim=1) / n
    var = torch.clamp(((arr * mask) ** 2).sum(dim=1) / n - mean ** 2, min=0.0)
    return mean, torch.sqrt(var)


class ResidualBlock(nn.Module):
    def __init__(self, input_dims, hidden_dims, output_dims):
        super().__init__()
        self.hidden_layer = nn.Sequential(nn.Linear(input_dims, hidden_dims), nn.SiLU())
        self.output_layer = nn.Linear(hidden_dims, output_dims)
        self.residual_layer = nn.Linear(input_dims, output_dims)

    def forward(self, x):
        return self.output_layer(self.hidden_layer(x)) + self.residual_layer(x)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(dim) * 0.1 + 1.0)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TimesFMAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scaling = nn.Parameter(torch.randn(head_dim) * 0.1)
        self.qkv_proj = nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size)

    def _per_dim_scaling(self, query):
        r_softplus_0 = 1.442695041
        scale = r_softplus_0 / math.sqrt(self.head_dim) * F.softplus(self.scaling)
        return query * scale[None, None, None, :]

    def forward(self, hidden_states, mask):
        batch_size, input_len, _ = hidden_states.shape
        xq, xk, xv = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        xq = xq.view(batch_size, -1, self.num_heads, self.head_dim)
        xk = xk.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xv = xv.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xq = self._per_dim_scaling(xq)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3))
        scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(q)
        output = torch.matmul(scores, v)
        output = output.transpose(1, 2).contiguous().view(batch_size, input_len, -1)
        return scores, self.o_proj(output)


class TransformerMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size)
        self.down_proj = nn.Linear(intermediate_size, hidden_size)
        self.layer_norm = nn.LayerNorm(hidden_size, eps=1e-6)

    def forward(self, x, paddings=None):
        outputs = self.down_proj(F.relu(self.gate_proj(self.layer_norm(x))))
        if paddings is not None:
            outputs = outputs * (1.0 - paddings[:, :, None])
        return outputs + x


class TimesFMDecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = TimesFMAttention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim)
        self.mlp = TransformerMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, hidden_states, mask, paddings):
        _, attn = self.self_attn(self.input_layernorm(hidden_states), mask)
        return self.mlp(hidden_states + attn, paddings=paddings)


class StackedDecoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.layers = nn.ModuleList([TimesFMDecoderLayer(c) for _ in range(c.num_layers)])

    def forward(self, hidden_states, paddings):
        padding_mask = convert_paddings_to_mask(paddings, hidden_states.dtype)
        atten_mask = causal_mask(hidden_states)
        mask = merge_masks(padding_mask, atten_mask)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, paddings)
        return hidden_states


def sinusoidal_position_embedding(seq_length, embedding_dims):
    position = torch.arange(seq_length, dtype=torch.float32)
    num_timescales = embedding_dims // 2
    log_inc = math.log(10000.0) / max(num_timescales - 1, 1)
    inv_timescales = torch.exp(torch.arange(num_timescales, dtype=torch.float32) * -log_inc)
    scaled = position[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)[None]


class PatchedTimeSeriesDecoder(nn.Module):
    """Patched decoder for time-series forecasting (decode of the next horizon from the last patch)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        c = config
        self.input_ff_layer = ResidualBlock(2 * c.patch_len, c.intermediate_size, c.hidden_size)
        self.freq_emb = nn.Embedding(3, c.hidden_size)
        self.horizon_ff_layer = ResidualBlock(c.hidden_size, c.intermediate_size,
                                              c.horizon_len * (1 + len(c.quantiles)))
        self.stacked_transformer = StackedDecoder(c)

    def forward(self, input_ts, input_padding, freq):
        c = self.config
        bsize = input_ts.shape[0]
        patched_inputs = input_ts.view(bsize, -1, c.patch_len)
        patched_pads = input_padding.view(bsize, -1, c.patch_len)
        patched_inputs = torch.where(torch.abs(patched_pads - 1.0) < c.tolerance, 0.0, patched_inputs)
        mu, sigma = _masked_mean_std(patched_inputs, patched_pads)
        sigma = torch.where(sigma < c.tolerance, torch.ones_like(sigma), sigma)
        patched_inputs = (patched_inputs - mu[:, None, None]) / sigma[:, None, None]
        patched_inputs = torch.where(torch.abs(patched_pads - 1.0) < c.tolerance, 0.0, patched_inputs)
        concat_inputs = torch.cat([patched_inputs, patched_pads], dim=-1)
        model_input = self.input_ff_layer(concat_inputs)
        # A patch counts as padded only if every step in it is padding.
        patched_padding = torch.min(patched_pads, dim=-1)[0]
        if c.use_positional_embedding:
            pos_emb = sinusoidal_position_embedding(model_input.shape[1], c.hidden_size).expand(bsize, -1, -1)
            pos_emb = _shift_padded_seq(patched_padding, pos_emb)
            model_input = model_input + pos_emb
        model_input = model_input + self.freq_emb(freq)
        model_output = self.stacked_transformer(model_input, patched_padding)
        out = self.horizon_ff_layer(model_output[:, -1])
        out = out.view(bsize, c.horizon_len, 1 + len(c.quantiles))
        return out * sigma[:, None, None] + mu[:, None, None]


def main():
    torch.manual_seed(0)
    config = TimesFMConfig()
    model = PatchedTimeSeriesDecoder(config).eval()
    context_len = 24  # 6 patches
    # Intermittent demand: real zeros, including a whole patch of them.
    long_series = torch.tensor([0., 3., 0., 0., 5., 0., 0., 2., 0., 0., 0., 0.,
                                4., 0., 1., 0., 0., 6., 0., 0., 2., 0., 0., 3.])
    short_series = torch.tensor([2., 0., 0., 1., 0., 0., 0., 0., 3., 0., 4., 0.,
                                 0., 0., 0., 5.])  # 4 patches, padded on the left by 2
    pad = context_len - short_series.numel()
    input_ts = torch.stack([long_series, torch.cat([torch.zeros(pad), short_series])])
    input_padding = torch.stack([torch.zeros(context_len),
                                 torch.cat([torch.ones(pad), torch.zeros(short_series.numel())])])
    freq = torch.zeros(2, 1, dtype=torch.long)
    with torch.no_grad():
        batched = model(input_ts, input_padding, freq)
        alone = model(short_series[None], torch.zeros(1, short_series.numel()), freq[:1])
    assert torch.allclose(batched[1], alone[0], atol=1e-4), (batched[1] - alone[0]).abs().max()
    print("timesfm forecast ok:", tuple(batched.shape))


if __name__ == "__main__":
    main()
