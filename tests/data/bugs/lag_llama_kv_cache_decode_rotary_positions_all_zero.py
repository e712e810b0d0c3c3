# time-series-foundation-models/lag-llama commit 4a2d099 ("Fix rotary embeddings with kv_cache", part of PR #84)
# With use_kv_cache, each decode step runs CausalSelfAttention with T=1 against the cached (unrotated) keys, but
# RoPE was built with seq_len=T=1 and applied with position_ids=None: the new query and every cached key were all
# rotated as position 0, so at decode the attention lost every relative position within the context window.
import math
import sys
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv


def unsqueeze_expand(tensor, dim, size):
    tensor = tensor.unsqueeze(dim)
    shape = list(tensor.shape)
    shape[dim] = size
    return tensor.expand(*shape)


def lagged_sequence_values(indices, prior_sequence, sequence, dim):
    assert max(indices) <= prior_sequence.shape[dim]
    full_sequence = torch.cat((prior_sequence, sequence), dim=dim)
    lags_values = []
    for lag_index in indices:
        begin_index = -lag_index - sequence.shape[dim]
        end_index = -lag_index if lag_index > 0 else None
        lags_values.append(full_sequence.narrow(dim, full_sequence.shape[dim] + begin_index,
                                                (end_index if end_index is not None else 0) - begin_index))
    return torch.stack(lags_values, dim=-1)


class MeanScaler(nn.Module):
    def __init__(self, dim: int = -1, keepdim: bool = False, minimum_scale: float = 1e-10):
        super().__init__()
        self.dim = dim
        self.keepdim = keepdim
        self.minimum_scale = minimum_scale

    def forward(self, data, weights):
        ts_sum = (data * weights).abs().sum(self.dim, keepdim=True)
        num_observed = weights.sum(self.dim, keepdim=True)
        scale = ts_sum / torch.clamp(num_observed, min=1)
        batch_sum = ts_sum.sum(dim=0)
        batch_observations = torch.clamp(num_observed.sum(0), min=1)
        default_scale = torch.squeeze(batch_sum / batch_observations)
        scale = torch.where(num_observed > 0, scale, default_scale * torch.ones_like(num_observed))
        scale = torch.clamp(scale, min=self.minimum_scale)
        scaled_data = data / scale
        if not self.keepdim:
            scale = scale.squeeze(dim=self.dim)
        return scaled_data, torch.zeros_like(scale), scale


class StudentTOutput:
    args_dim = {"df": 1, "loc": 1, "scale": 1}

    class _Proj(nn.Module):
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.ModuleList([nn.Linear(in_features, 1) for _ in range(3)])

        def forward(self, x):
            df, loc, scale = [p(x).squeeze(-1) for p in self.proj]
            return 2.0 + F.softplus(df), loc, F.softplus(scale) + 1e-6

    def get_args_proj(self, in_features):
        return self._Proj(in_features)

    def distribution(self, distr_args, loc=None, scale=None):
        df, mu, sigma = distr_args
        return torch.distributions.StudentT(df, mu * scale + loc, sigma * scale)


@dataclass
class LTSMConfig:
    feature_size: int = 3 + 6
    block_size: int = 2048
    n_layer: int = 32
    n_head: int = 32
    n_embd_per_head: int = 128
    rope_scaling: Optional[dict] = None
    dropout: float = 0.0


class Block(nn.Module):
    def __init__(self, config: LTSMConfig) -> None:
        super().__init__()
        self.rms_1 = RMSNorm(config.n_embd_per_head * config.n_head)
        self.attn = CausalSelfAttention(config)
        self.rms_2 = RMSNorm(config.n_embd_per_head * config.n_head)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, use_kv_cache: bool) -> torch.Tensor:
        x = x + self.attn(self.rms_1(x), use_kv_cache)
        y = x + self.mlp(self.rms_2(x))
        return y


class LlamaRotaryEmbedding(torch.nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float().to(device) / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(seq_len=max_position_embeddings, device=self.inv_freq.device,
                                dtype=torch.get_default_dtype())

    def _set_cos_sin_cache(self, seq_len, device, dtype):
        self.max_seq_len_cached = seq_len
        t = torch.arange(self.max_seq_len_cached, device=device, dtype=self.inv_freq.dtype)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None, :, :].to(dtype), persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None, :, :].to(dtype), persistent=False)

    def forward(self, device, dtype, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len=seq_len, device=device, dtype=dtype)
        return (
            self.cos_cached[:, :, :seq_len, ...].to(dtype=dtype),
            self.sin_cached[:, :, :seq_len, ...].to(dtype=dtype),
        )


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)  # [seq_len, dim]
    sin = sin.squeeze(1).squeeze(0)  # [seq_len, dim]
    cos = cos[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    sin = sin[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class CausalSelfAttention(nn.Module):
    def __init__(self, config: LTSMConfig) -> None:
        super().__init__()
        self.q_proj = nn.Linear(config.n_embd_per_head * config.n_head, config.n_embd_per_head * config.n_head, bias=False)
        self.kv_proj = nn.Linear(config.n_embd_per_head * config.n_head, 2 * config.n_embd_per_head * config.n_head, bias=False)
        self.c_proj = nn.Linear(config.n_embd_per_head * config.n_head, config.n_embd_per_head * config.n_head, bias=False)
        self.n_head = config.n_head
        self.n_embd_per_head = config.n_embd_per_head
        self.block_size = config.block_size
        self.dropout = config.dropout
        self.rope_scaling = config.rope_scaling
        self.rotary_emb = LlamaRotaryEmbedding(self.n_embd_per_head, max_position_embeddings=self.block_size)
        self.kv_cache = None

    def forward(self, x: torch.Tensor, use_kv_cache: bool) -> torch.Tensor:
        (B, T, C) = x.size()

        q = self.q_proj(x)
        k, v = self.kv_proj(x).split(self.n_embd_per_head * self.n_head, dim=2)

        if use_kv_cache:
            # Optimized for single next prediction
            if self.kv_cache is not None:
                # Update cache
                k = torch.cat([self.kv_cache[0], k], dim=1)[:, 1:]
                v = torch.cat([self.kv_cache[1], v], dim=1)[:, 1:]
                self.kv_cache = k, v
            else:
                # Build cache
                self.kv_cache = k, v

        k = k.view(B, -1, self.n_head, self.n_embd_per_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, -1, self.n_head, self.n_embd_per_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, -1, self.n_head, self.n_embd_per_head).transpose(1, 2)  # (B, nh, T, hs)

        # This the true sequence length after concatenation with kv_cache,
        # will be the same as `T` when kv_cache is not in use
        true_seq_len = k.size(2)
        if self.rotary_emb is not None:
            if FIXED and use_kv_cache and T < true_seq_len:
                # q is the query vector for the last token, so it's position is the last index (-1)
                cos, sin = self.rotary_emb(device=v.device, dtype=v.dtype, seq_len=true_seq_len)
                q, _ = apply_rotary_pos_emb(q, k, cos, sin, position_ids=[-1])

                # k is the key matrix after concatenation with cache, so no position_ids
                cos, sin = self.rotary_emb(device=v.device, dtype=v.dtype, seq_len=true_seq_len)
                _, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids=None)
            else:
                cos, sin = self.rotary_emb(device=v.device, dtype=v.dtype, seq_len=T)
                q, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids=None)

        # When using kv cache at inference, is_causal=False since decoder is causal, at each generation step we want
        # to avoid recalculating the same previous token attention
        if use_kv_cache:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout, is_causal=False)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout, is_causal=True)

        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.c_proj(y)
        return y


def find_multiple(n: int, k: int) -> int:
    if n % k == 0:
        return n
    return n + k - (n % k)


class MLP(nn.Module):
    def __init__(self, config: LTSMConfig) -> None:
        super().__init__()
        hidden_dim = 4 * config.n_embd_per_head * config.n_head
        n_hidden = int(2 * hidden_dim / 3)
        n_hidden = find_multiple(n_hidden, 256)
        self.c_fc1 = nn.Linear(config.n_embd_per_head * config.n_head, n_hidden, bias=False)
        self.c_fc2 = nn.Linear(config.n_embd_per_head * config.n_head, n_hidden, bias=False)
        self.c_proj = nn.Linear(n_hidden, config.n_embd_per_head * config.n_head, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.c_fc1(x)) * self.c_fc2(x)
        x = self.c_proj(x)
        return x


class RMSNorm(nn.Module):
    def __init__(self, size: int, dim: int = -1, eps: float = 1e-5) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm_x = x.to(torch.float32).pow(2).mean(dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        return (self.scale * x_normed).type_as(x)


class LagLlamaModel(nn.Module):
    def __init__(self, context_length: int, max_context_length: int, scaling: str, input_size: int, n_layer: int,
                 n_embd_per_head: int, n_head: int, lags_seq: List[int], distr_output, rope_scaling=None,
                 num_parallel_samples: int = 100, time_feat: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.context_length = context_length
        self.lags_seq = lags_seq
        feature_size = input_size * (len(self.lags_seq)) + 2 * input_size
        config = LTSMConfig(n_layer=n_layer, n_embd_per_head=n_embd_per_head, n_head=n_head,
                            block_size=max_context_length, feature_size=feature_size,
                            rope_scaling=rope_scaling, dropout=dropout)
        self.num_parallel_samples = num_parallel_samples
        self.scaler = MeanScaler(keepdim=True, dim=1)
        self.distr_output = distr_output
        self.param_proj = self.distr_output.get_args_proj(config.n_embd_per_head * config.n_head)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Linear(config.feature_size, config.n_embd_per_head * config.n_head),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=RMSNorm(config.n_embd_per_head * config.n_head),
            )
        )
        self.y_cache = False  # used at time of inference when kv cached is used

    def prepare_input(self, past_target, past_observed_values, future_target=None):
        scaled_past_target, loc, scale = self.scaler(past_target, past_observed_values)
        input = scaled_past_target[..., max(self.lags_seq):]
        prior_input = (past_target[..., : max(self.lags_seq)] - loc) / scale
        lags = lagged_sequence_values(self.lags_seq, prior_input, input, dim=-1)
        static_feat = torch.cat((loc.abs().log1p(), scale.log()), dim=-1)
        expanded_static_feat = unsqueeze_expand(static_feat, dim=-2, size=lags.shape[-2])
        return torch.cat((lags, expanded_static_feat), dim=-1), loc, scale

    def forward(self, past_target, past_observed_values, use_kv_cache: bool = False):
        transformer_input, loc, scale = self.prepare_input(past_target=past_target,
                                                           past_observed_values=past_observed_values)
        # To use kv cache for inference and pass recent token to transformer
        if use_kv_cache and self.y_cache:
            # Only use the most recent one, rest is in cache
            transformer_input = transformer_input[:, -1:]

        x = self.transformer.wte(transformer_input)
        for block in self.transformer.h:
            x = block(x, use_kv_cache)
        x = self.transformer.ln_f(x)
        if use_kv_cache:
            self.y_cache = True
        params = self.param_proj(x)
        return params, loc, scale

    def reset_cache(self) -> None:
        """
        Resets all cached key-values in attention.
        Has to be called after prediction loop in predictor
        """
        self.y_cache = False
        for block in self.transformer.h:
            block.attn.kv_cache = None


class LagLlamaLightningModule(nn.Module):
    def __init__(self, model_kwargs, prediction_length, use_kv_cache=True):
        super().__init__()
        self.model = LagLlamaModel(**model_kwargs)
        self.prediction_length = prediction_length
        self.use_kv_cache = use_kv_cache

    # greedy prediction
    @torch.no_grad()
    def forward(self, past_target, past_observed_values):
        future_samples = []
        for t in range(self.prediction_length):
            params, loc, scale = self.model(past_target=past_target, past_observed_values=past_observed_values,
                                            use_kv_cache=self.use_kv_cache)
            sliced_params = [p[:, -1:] for p in params]
            distr = self.model.distr_output.distribution(sliced_params, loc, scale)
            greedy_prediction = distr.mean  # (#bsz, 1)
            future_samples.append(greedy_prediction)
            past_target = torch.cat((past_target, greedy_prediction), dim=1)
            past_observed_values = torch.cat((past_observed_values, torch.ones_like(greedy_prediction)), dim=1)
        self.model.reset_cache()
        return torch.cat(future_samples, dim=-1)


def main():
    torch.manual_seed(0)
    lags_seq = [1, 2, 3, 4, 7, 14]
    context_length = 32
    prediction_length = 6
    module = LagLlamaLightningModule(
        dict(context_length=context_length, max_context_length=128, scaling="mean", input_size=1, n_layer=2,
             n_embd_per_head=16, n_head=4, lags_seq=lags_seq, distr_output=StudentTOutput()),
        prediction_length=prediction_length,
    ).eval()
    t = torch.arange(context_length + max(lags_seq), dtype=torch.float32)
    batches = [
        torch.stack([10 + torch.sin(t / 3), 5 + torch.cos(t / 5)]),
    ]
    for i, past_target in enumerate(batches):
        forecast = module(past_target, torch.ones_like(past_target))
        print(f"batch {i} forecast norm {forecast.norm().item():.4f}")


if __name__ == "__main__":
    main()
