"""TimesFM 2.5 (PyTorch) batched forecasting with a KV decode cache, shrunk to toy sizes.

Port of google-research/timesfm @3dae50b20d7a724981e8ea36cda75578f80dd2dc:
  src/timesfm/torch/transformer.py (make_attn_mask, RotaryPositionalEmbedding,
    _torch_dot_product_attention = F.scaled_dot_product_attention with a boolean mask and
    scale=1.0, PerDimScale, MultiHeadAttention with fuse_qkv and its DecodeCache, Transformer)
  src/timesfm/torch/util.py (DecodeCache, update_running_stats, revin)
  src/timesfm/torch/dense.py, src/timesfm/torch/normalization.py (ResidualBlock, RMSNorm)
  src/timesfm/timesfm_2p5/timesfm_2p5_torch.py
    (TimesFM_2p5_200M_torch_module.forward / decode / forecast_naive, compile's _compiled_decode)
  src/timesfm/timesfm_2p5/timesfm_2p5_base.py
    (TimesFM_2p5.forecast: strip leading NaNs, interpolate, LEFT pad to max_context with
     zeros and mask True, pad the batch to global_batch_size)

Contexts of different lengths are left padded to max_context.  The per-patch mask is the
mask of the patch's last time point (masks[..., -1]); num_masked counts the masked patches
and is kept in each layer's DecodeCache, so the causal mask over the cache also drops the
leading padded patches (kv_index >= num_all_masked_kv) and RoPE positions start at 0 on the
first real patch.  Running mean / std skip masked points.  Padded query rows are fully
masked (all-False boolean rows in SDPA): their outputs are never read.

Reference: each series forecast alone with forecast_naive (padded in front only up to a
multiple of the patch length, as the project does), float64, and a no-cache recompute of the
whole patch sequence for the last decode step.
"""
import dataclasses
import math
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

torch.set_default_dtype(torch.float64)
torch.manual_seed(0)


# ---------------------------------------------------------------- configs.py


@dataclasses.dataclass(frozen=True)
class ResidualBlockConfig:
  input_dims: int
  hidden_dims: int
  output_dims: int
  use_bias: bool
  activation: str


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  model_dims: int
  hidden_dims: int
  num_heads: int
  attention_norm: str
  feedforward_norm: str
  qk_norm: str
  use_bias: bool
  use_rotary_position_embeddings: bool
  ff_activation: str
  fuse_qkv: bool


@dataclasses.dataclass(frozen=True)
class StackedTransformersConfig:
  num_layers: int
  transformer: TransformerConfig


@dataclasses.dataclass(frozen=False)
class ForecastConfig:
  max_context: int = 0
  max_horizon: int = 0
  normalize_inputs: bool = False
  per_core_batch_size: int = 1
  use_continuous_quantile_head: bool = False
  force_flip_invariance: bool = False
  infer_is_positive: bool = False
  fix_quantile_crossing: bool = False
  return_backcast: bool = False


@dataclasses.dataclass(frozen=True)
class TimesFM_2p5_Tiny_Definition:
  """TimesFM_2p5_200M_Definition with toy sizes."""

  context_limit = 256
  input_patch_len: int = 4
  output_patch_len: int = 8
  output_quantile_len: int = 16
  quantiles: list = dataclasses.field(
    default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
  )
  decode_index: int = 5
  tokenizer: ResidualBlockConfig = ResidualBlockConfig(
    input_dims=8, hidden_dims=16, output_dims=16, use_bias=True, activation="swish"
  )
  stacked_transformers: StackedTransformersConfig = StackedTransformersConfig(
    num_layers=2,
    transformer=TransformerConfig(
      model_dims=16,
      hidden_dims=16,
      num_heads=2,
      attention_norm="rms",
      feedforward_norm="rms",
      qk_norm="rms",
      use_bias=False,
      use_rotary_position_embeddings=True,
      ff_activation="swish",
      fuse_qkv=True,
    ),
  )
  output_projection_point: ResidualBlockConfig = ResidualBlockConfig(
    input_dims=16, hidden_dims=16, output_dims=8 * 10, use_bias=False, activation="swish"
  )
  output_projection_quantiles: ResidualBlockConfig = ResidualBlockConfig(
    input_dims=16, hidden_dims=16, output_dims=16 * 10, use_bias=False, activation="swish"
  )


# ---------------------------------------------------------------- torch/util.py

_TOLERANCE = 1e-6


@dataclasses.dataclass(frozen=False)
class DecodeCache:
  """Cache for decoding."""

  next_index: torch.Tensor
  num_masked: torch.Tensor
  key: torch.Tensor
  value: torch.Tensor


def update_running_stats(n, mu, sigma, x, mask):
  """Updates the running stats."""
  is_legit = torch.logical_not(mask)
  inc_n = torch.sum(is_legit.to(x.dtype), dim=-1)

  inc_mu_numerator = torch.sum(x * is_legit, dim=-1)
  inc_n_safe = torch.where(inc_n == 0, 1.0, inc_n)
  inc_mu = inc_mu_numerator / inc_n_safe
  inc_mu = torch.where(inc_n == 0, 0.0, inc_mu)

  inc_var_numerator = torch.sum(((x - inc_mu.unsqueeze(-1)) ** 2) * is_legit, dim=-1)
  inc_var = inc_var_numerator / inc_n_safe
  inc_var = torch.where(inc_n == 0, 0.0, inc_var)
  inc_sigma = torch.sqrt(inc_var)

  new_n = n + inc_n
  new_n_safe = torch.where(new_n == 0, 1.0, new_n)

  new_mu = (n * mu + inc_mu * inc_n) / new_n_safe
  new_mu = torch.where(new_n == 0, 0.0, new_mu)

  term1 = n * sigma.pow(2)
  term2 = inc_n * inc_sigma.pow(2)
  term3 = n * (mu - new_mu).pow(2)
  term4 = inc_n * (inc_mu - new_mu).pow(2)

  new_var = (term1 + term2 + term3 + term4) / new_n_safe
  new_var = torch.where(new_n == 0, 0.0, new_var)
  new_sigma = torch.sqrt(torch.clamp(new_var, min=0.0))

  return (w := (new_n, new_mu, new_sigma), w)


def revin(x, mu, sigma, reverse: bool = False):
  """Reversible instance normalization."""
  if len(mu.shape) == len(x.shape) - 1:
    mu = mu[..., None]
    sigma = sigma[..., None]
  elif len(mu.shape) == len(x.shape) - 2:
    mu = mu[..., None, None]
    sigma = sigma[..., None, None]

  if reverse:
    return x * sigma + mu
  else:
    return (x - mu) / torch.where(sigma < _TOLERANCE, 1.0, sigma)


# ---------------------------------------------------------------- torch/normalization.py, dense.py


class RMSNorm(nn.Module):
  """RMS normalization."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6):
    super().__init__()
    self.scale = nn.Parameter(torch.zeros(num_features))
    self.num_features = num_features
    self.epsilon = epsilon

  def forward(self, inputs: torch.Tensor) -> torch.Tensor:
    var = torch.mean(torch.square(inputs), dim=-1, keepdim=True)
    normed_inputs = inputs * torch.rsqrt(var + self.epsilon)
    normed_inputs = normed_inputs * self.scale
    return normed_inputs


class ResidualBlock(nn.Module):
  """Residual block with two linear layers and a linear residual connection."""

  def __init__(self, config: ResidualBlockConfig):
    super().__init__()
    self.config = config
    self.hidden_layer = nn.Linear(config.input_dims, config.hidden_dims, bias=config.use_bias)
    self.output_layer = nn.Linear(config.hidden_dims, config.output_dims, bias=config.use_bias)
    self.residual_layer = nn.Linear(config.input_dims, config.output_dims, bias=config.use_bias)
    if config.activation == "relu":
      self.activation = nn.ReLU()
    elif config.activation == "swish":
      self.activation = nn.SiLU()
    elif config.activation == "none":
      self.activation = nn.Identity()
    else:
      raise ValueError(f"Activation: {config.activation} not supported.")

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.output_layer(self.activation(self.hidden_layer(x))) + self.residual_layer(x)


# ---------------------------------------------------------------- torch/transformer.py


def make_attn_mask(
    query_length: int,
    num_all_masked_kv: torch.Tensor,
    query_index_offset: Optional[torch.Tensor] = None,
    kv_length: int = 0,
) -> torch.Tensor:
  """Makes attention mask."""
  if kv_length == 0:
    kv_length = query_length

  q_index = torch.arange(query_length, device=num_all_masked_kv.device)[None, None, :, None]
  if query_index_offset is not None:
    q_index = q_index + query_index_offset[:, None, None, None]
  kv_index = torch.arange(kv_length, device=num_all_masked_kv.device)[None, None, None, :]
  return torch.logical_and(
      q_index >= kv_index,
      kv_index >= num_all_masked_kv[:, None, None, None],
  )


class RotaryPositionalEmbedding(nn.Module):
  """Rotary positional embedding."""

  def __init__(self, embedding_dims: int, min_timescale: float = 1.0, max_timescale: float = 10000.0):
    super().__init__()
    self.embedding_dims = embedding_dims
    self.min_timescale = min_timescale
    self.max_timescale = max_timescale

  def forward(self, inputs: torch.Tensor, position: Optional[torch.Tensor] = None):
    """Generates a JTensor of sinusoids with different frequencies."""
    if self.embedding_dims != inputs.shape[-1]:
      raise ValueError(
          "The embedding dims of the rotary position embedding"
          "must match the hidden dimension of the inputs."
      )
    half_embedding_dim = self.embedding_dims // 2
    fraction = 2 * torch.arange(0, half_embedding_dim, device=inputs.device) / self.embedding_dims
    timescale = (
        self.min_timescale * (self.max_timescale / self.min_timescale) ** fraction
    ).to(inputs.device)
    if position is None:
      seq_length = inputs.shape[1]
      position = torch.arange(seq_length, dtype=torch.float32, device=inputs.device)[None, :]

    if len(inputs.shape) == 4:
      position = position[..., None, None]
      timescale = timescale[None, None, None, :]
    elif len(inputs.shape) == 3:
      position = position[..., None]
      timescale = timescale[None, None, :]
    else:
      raise ValueError("Inputs must be of rank 3 or 4.")

    sinusoid_inp = position / timescale
    sin = torch.sin(sinusoid_inp)
    cos = torch.cos(sinusoid_inp)
    first_half, second_half = torch.chunk(inputs, 2, dim=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    return torch.cat([first_part, second_part], dim=-1)


def _torch_dot_product_attention(query, key, value, mask=None):
  """Unscaled attention through the fused F.scaled_dot_product_attention kernel."""
  # (B, L, H, D) -> (B, H, L, D)
  query = query.permute(0, 2, 1, 3)
  key = key.permute(0, 2, 1, 3)
  value = value.permute(0, 2, 1, 3)

  # scale=1.0: PerDimScale already scaled the query.
  output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=1.0)

  return output.permute(0, 2, 1, 3)


class PerDimScale(nn.Module):
  """Per-dimension scaling."""

  def __init__(self, num_dims: int):
    super().__init__()
    self.num_dims = num_dims
    self.per_dim_scale = nn.Parameter(torch.zeros(num_dims))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    scale_factor = 1.442695041 / math.sqrt(self.num_dims) * F.softplus(self.per_dim_scale)
    return x * scale_factor


class MultiHeadAttention(nn.Module):
  """Multi-head attention."""

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      *,
      use_per_dim_scale: bool = True,
      use_rotary_position_embeddings: bool = True,
      use_bias: bool = False,
      attention_fn: Callable[..., torch.Tensor] = _torch_dot_product_attention,
      qk_norm: str = "rms",
      fuse_qkv: bool = False,
  ):
    super().__init__()
    self.num_heads = num_heads
    self.in_features = in_features
    self.head_dim = in_features // num_heads
    self.use_bias = use_bias
    self.attention_fn = attention_fn
    self.qk_norm = qk_norm
    self.fuse_qkv = fuse_qkv

    if self.in_features % self.num_heads != 0:
      raise ValueError(
          f"Memory dimension ({self.in_features}) must be divisible by "
          f"'num_heads' heads ({self.num_heads})."
      )

    if self.fuse_qkv:
      self.qkv_proj = nn.Linear(self.in_features, 3 * self.in_features, bias=use_bias)
    else:
      self.query = nn.Linear(self.in_features, self.in_features, bias=use_bias)
      self.key = nn.Linear(self.in_features, self.in_features, bias=use_bias)
      self.value = nn.Linear(self.in_features, self.in_features, bias=use_bias)
    self.out = nn.Linear(self.in_features, self.in_features, bias=use_bias)

    if self.qk_norm == "rms":
      self.query_ln = RMSNorm(self.head_dim)
      self.key_ln = RMSNorm(self.head_dim)
    else:
      self.query_ln = nn.Identity()
      self.key_ln = nn.Identity()

    self.use_rotary_position_embeddings = use_rotary_position_embeddings
    if self.use_rotary_position_embeddings:
      self.rotary_position_embedding = RotaryPositionalEmbedding(embedding_dims=self.head_dim)

    self.use_per_dim_scale = use_per_dim_scale
    if use_per_dim_scale:
      self.per_dim_scale = PerDimScale(num_dims=self.head_dim)

  def forward(
      self,
      inputs_q: torch.Tensor,
      *,
      decode_cache: Optional[DecodeCache] = None,
      patch_mask: Optional[torch.Tensor] = None,
  ) -> Tuple[torch.Tensor, Optional[DecodeCache]]:
    b, n_patches, _ = inputs_q.shape
    if patch_mask is None:
      patch_mask = torch.zeros(b, n_patches, dtype=torch.bool, device=inputs_q.device)

    if self.fuse_qkv:
      qkv = self.qkv_proj(inputs_q)
      query, key, value = torch.chunk(qkv, 3, dim=-1)
      query = query.view(b, n_patches, self.num_heads, self.head_dim)
      key = key.view(b, n_patches, self.num_heads, self.head_dim)
      value = value.view(b, n_patches, self.num_heads, self.head_dim)
    else:
      query = self.query(inputs_q).view(b, n_patches, self.num_heads, self.head_dim)
      key = self.key(inputs_q).view(b, n_patches, self.num_heads, self.head_dim)
      value = self.value(inputs_q).view(b, n_patches, self.num_heads, self.head_dim)

    if decode_cache is None:
      num_masked = torch.sum(patch_mask.to(torch.int32), dim=-1)
      next_index = torch.zeros_like(num_masked, dtype=torch.int32)
    else:
      num_masked = torch.sum(patch_mask.to(torch.int32), dim=-1) + decode_cache.num_masked
      next_index = decode_cache.next_index.clone()

    if self.use_rotary_position_embeddings:
      position = (
          torch.arange(n_patches, device=inputs_q.device)[None, :]
          + next_index[:, None]
          - num_masked[:, None]
      )
      query = self.rotary_position_embedding(query, position)
      key = self.rotary_position_embedding(key, position)

    query = self.query_ln(query)
    key = self.key_ln(key)

    if self.use_per_dim_scale:
      query = self.per_dim_scale(query)

    if decode_cache is not None:
      _, decode_cache_size, _, _ = decode_cache.value.shape

      start = decode_cache.next_index[0]
      end = start + n_patches

      # One slice assignment for the whole batch (every row has the same next_index).
      decode_cache.key[:, start:end] = key
      decode_cache.value[:, start:end] = value

      key = decode_cache.key
      value = decode_cache.value
      decode_cache.next_index += n_patches
      decode_cache.num_masked = num_masked
      attn_mask = make_attn_mask(
          query_length=n_patches,
          num_all_masked_kv=num_masked,
          query_index_offset=next_index,
          kv_length=decode_cache_size,
      )
    else:
      attn_mask = make_attn_mask(query_length=n_patches, num_all_masked_kv=num_masked)

    x = self.attention_fn(query, key, value, mask=attn_mask)
    x = x.reshape(b, n_patches, self.in_features)
    out = self.out(x)
    return out, decode_cache


class Transformer(nn.Module):
  """Classic Transformer used in TimesFM."""

  def __init__(self, config: TransformerConfig):
    super().__init__()
    self.config = config

    if config.attention_norm == "rms":
      self.pre_attn_ln = RMSNorm(num_features=config.model_dims)
      self.post_attn_ln = RMSNorm(num_features=config.model_dims)
    else:
      raise ValueError(f"Layer norm: {config.attention_norm} not supported.")

    self.attn = MultiHeadAttention(
        num_heads=config.num_heads,
        in_features=config.model_dims,
        use_per_dim_scale=True,
        use_rotary_position_embeddings=config.use_rotary_position_embeddings,
        qk_norm=config.qk_norm,
        fuse_qkv=config.fuse_qkv,
    )

    if config.feedforward_norm == "rms":
      self.pre_ff_ln = RMSNorm(num_features=config.model_dims)
      self.post_ff_ln = RMSNorm(num_features=config.model_dims)
    else:
      raise ValueError(f"Layer norm: {config.feedforward_norm} not supported.")

    self.ff0 = nn.Linear(config.model_dims, config.hidden_dims, bias=config.use_bias)
    self.ff1 = nn.Linear(config.hidden_dims, config.model_dims, bias=config.use_bias)
    if config.ff_activation == "relu":
      self.activation = nn.ReLU()
    elif config.ff_activation == "swish":
      self.activation = nn.SiLU()
    elif config.ff_activation == "none":
      self.activation = nn.Identity()
    else:
      raise ValueError(f"Activation: {config.ff_activation} not supported.")

  def forward(
      self,
      input_embeddings: torch.Tensor,
      patch_mask: torch.Tensor,
      decode_cache: Optional[DecodeCache] = None,
  ) -> Tuple[torch.Tensor, Optional[DecodeCache]]:
    attn_output, decode_cache = self.attn(
        inputs_q=self.pre_attn_ln(input_embeddings),
        decode_cache=decode_cache,
        patch_mask=patch_mask,
    )
    attn_output = self.post_attn_ln(attn_output) + input_embeddings
    output_embeddings = (
        self.post_ff_ln(self.ff1(self.activation(self.ff0(self.pre_ff_ln(attn_output)))))
        + attn_output
    )
    return output_embeddings, decode_cache


# ---------------------------------------------------------------- timesfm_2p5_torch.py


class TimesFM_2p5_torch_module(nn.Module):
  """TimesFM 2.5, toy sizes."""

  config = TimesFM_2p5_Tiny_Definition()

  def __init__(self):
    super().__init__()

    # Names constants.
    self.p = self.config.input_patch_len
    self.o = self.config.output_patch_len
    self.os = self.config.output_quantile_len
    self.m = self.o // self.p
    self.x = self.config.stacked_transformers.num_layers
    self.h = self.config.stacked_transformers.transformer.num_heads
    self.md = self.config.stacked_transformers.transformer.model_dims
    self.hd = self.md // self.h
    self.q = len(self.config.quantiles) + 1
    self.aridx = self.config.decode_index

    # Layers.
    self.tokenizer = ResidualBlock(self.config.tokenizer)
    self.stacked_xf = nn.ModuleList(
      [Transformer(self.config.stacked_transformers.transformer) for _ in range(self.x)]
    )
    self.output_projection_point = ResidualBlock(self.config.output_projection_point)
    self.output_projection_quantiles = ResidualBlock(self.config.output_projection_quantiles)

    self.device = torch.device("cpu")
    self.device_count = 1

  def forward(
    self,
    inputs: torch.Tensor,
    masks: torch.Tensor,
    decode_caches: Optional[list] = None,
  ):
    tokenizer_inputs = torch.cat([inputs, masks.to(inputs.dtype)], dim=-1)
    input_embeddings = self.tokenizer(tokenizer_inputs)

    if decode_caches is None:
      decode_caches = [None] * self.x

    output_embeddings = input_embeddings
    new_decode_caches = []
    for i, layer in enumerate(self.stacked_xf):
      output_embeddings, new_cache = layer(output_embeddings, masks[..., -1], decode_caches[i])
      new_decode_caches.append(new_cache)
    output_ts = self.output_projection_point(output_embeddings)
    output_quantile_spread = self.output_projection_quantiles(output_embeddings)

    return (
      input_embeddings,
      output_embeddings,
      output_ts,
      output_quantile_spread,
    ), new_decode_caches

  def decode(self, horizon: int, inputs, masks, trace=None):
    """Decodes the time series."""

    with torch.no_grad():
      batch_size, context = inputs.shape[0], inputs.shape[1]
      num_decode_steps = (horizon - 1) // self.o
      num_input_patches = context // self.p
      decode_cache_size = num_input_patches + num_decode_steps * self.m

      # Prefill
      patched_inputs = torch.reshape(inputs, (batch_size, -1, self.p))
      patched_masks = torch.reshape(masks, (batch_size, -1, self.p))

      # running stats
      n = torch.zeros(batch_size, device=inputs.device)
      mu = torch.zeros(batch_size, device=inputs.device)
      sigma = torch.zeros(batch_size, device=inputs.device)
      patch_mu = []
      patch_sigma = []
      for i in range(num_input_patches):
        (n, mu, sigma), _ = update_running_stats(
          n, mu, sigma, patched_inputs[:, i], patched_masks[:, i]
        )
        patch_mu.append(mu)
        patch_sigma.append(sigma)
      last_n, last_mu, last_sigma = n, mu, sigma
      context_mu = torch.stack(patch_mu, dim=1)
      context_sigma = torch.stack(patch_sigma, dim=1)

      decode_caches = [
        DecodeCache(
          next_index=torch.zeros(batch_size, dtype=torch.int32, device=inputs.device),
          num_masked=torch.zeros(batch_size, dtype=torch.int32, device=inputs.device),
          key=torch.zeros(batch_size, decode_cache_size, self.h, self.hd, device=inputs.device),
          value=torch.zeros(batch_size, decode_cache_size, self.h, self.hd, device=inputs.device),
        )
        for _ in range(self.x)
      ]

      normed_inputs = revin(patched_inputs, context_mu, context_sigma, reverse=False)
      normed_inputs = torch.where(patched_masks, 0.0, normed_inputs)
      (_, _, normed_outputs, normed_quantile_spread), decode_caches = self(
        normed_inputs, patched_masks, decode_caches
      )
      if trace is not None:
        trace.append((normed_inputs, patched_masks, normed_outputs))
      renormed_outputs = torch.reshape(
        revin(normed_outputs, context_mu, context_sigma, reverse=True),
        (batch_size, -1, self.o, self.q),
      )
      renormed_quantile_spread = torch.reshape(
        revin(normed_quantile_spread, context_mu, context_sigma, reverse=True),
        (batch_size, -1, self.os, self.q),
      )[:, -1, ...]

      # Autogressive decode
      ar_outputs = []
      last_renormed_output = renormed_outputs[:, -1, :, self.aridx]

      for _ in range(num_decode_steps):
        new_patched_input = torch.reshape(last_renormed_output, (batch_size, self.m, self.p))
        new_mask = torch.zeros_like(new_patched_input, dtype=torch.bool)

        n, mu, sigma = last_n, last_mu, last_sigma
        new_mus, new_sigmas = [], []
        for i in range(self.m):
          (n, mu, sigma), _ = update_running_stats(
            n, mu, sigma, new_patched_input[:, i], new_mask[:, i]
          )
          new_mus.append(mu)
          new_sigmas.append(sigma)
        last_n, last_mu, last_sigma = n, mu, sigma
        new_mu = torch.stack(new_mus, dim=1)
        new_sigma = torch.stack(new_sigmas, dim=1)

        new_normed_input = revin(new_patched_input, new_mu, new_sigma, reverse=False)
        (_, _, new_normed_output, _), decode_caches = self(
          new_normed_input, new_mask, decode_caches
        )
        if trace is not None:
          trace.append((new_normed_input, new_mask, new_normed_output))

        new_renormed_output = torch.reshape(
          revin(new_normed_output, new_mu, new_sigma, reverse=True),
          (batch_size, self.m, self.o, self.q),
        )
        ar_outputs.append(new_renormed_output[:, -1, ...])
        last_renormed_output = new_renormed_output[:, -1, :, self.aridx]

      if num_decode_steps > 0:
        ar_renormed_outputs = torch.stack(ar_outputs, dim=1)
      else:
        ar_renormed_outputs = None

    return renormed_outputs, renormed_quantile_spread, ar_renormed_outputs

  def forecast_naive(self, horizon: int, inputs: Sequence[np.ndarray]) -> list:
    """Forecasts the time series, one series at a time (debugging path)."""
    outputs = []
    for each_input in inputs:
      input_t = torch.tensor(each_input, dtype=torch.float64)
      mask = torch.zeros_like(input_t, dtype=torch.bool)
      len_front_mask = self.p - (len(each_input) % self.p)
      if len_front_mask < self.p:
        input_t = torch.cat([torch.zeros(len_front_mask, dtype=torch.float64), input_t], dim=0)
        mask = torch.cat([torch.ones(len_front_mask, dtype=torch.bool), mask], dim=0)
      input_t = input_t[None, ...]
      mask = mask[None, ...]
      t_pf, _, t_ar = self.decode(horizon, input_t, mask)
      to_concat = [t_pf[:, -1, ...]]
      if t_ar is not None:
        to_concat.append(t_ar.reshape(1, -1, self.q))
      torch_forecast = torch.cat(to_concat, dim=1)[..., :horizon]
      torch_forecast = torch_forecast.squeeze(0)
      outputs.append(torch_forecast.detach().cpu().numpy())
    return outputs


# ---------------------------------------------------------------- timesfm_2p5_base.py


def strip_leading_nans(arr):
  isnan = np.isnan(arr)
  first_valid_index = np.argmax(~isnan)
  return arr[first_valid_index:]


def linear_interpolation(arr):
  nans = np.isnan(arr)
  if not np.any(nans):
    return arr

  def x(z):
    return z.nonzero()[0]

  nans_indices = x(nans)
  non_nans_indices = x(~nans)
  non_nans_values = arr[~nans]
  arr[nans] = np.interp(nans_indices, non_nans_indices, non_nans_values)
  return arr


class TimesFM_2p5_torch:
  """TimesFM_2p5 + TimesFM_2p5_200M_torch (compile / forecast), toy model."""

  def __init__(self):
    self.model = TimesFM_2p5_torch_module()
    self.forecast_config = None
    self.compiled_decode = None
    self.global_batch_size = 0

  def compile(self, forecast_config: ForecastConfig) -> None:
    self.global_batch_size = forecast_config.per_core_batch_size * self.model.device_count
    fc = forecast_config
    if fc.max_context % self.model.p != 0:
      fc = dataclasses.replace(fc, max_context=math.ceil(fc.max_context / self.model.p) * self.model.p)
    if fc.max_horizon % self.model.o != 0:
      fc = dataclasses.replace(fc, max_horizon=math.ceil(fc.max_horizon / self.model.o) * self.model.o)
    if fc.max_context + fc.max_horizon > self.model.config.context_limit:
      raise ValueError("Context + horizon must be less than the context limit.")
    self.forecast_config = fc

    def _compiled_decode(horizon, inputs, masks):
      if horizon > fc.max_horizon:
        raise ValueError(f"Horizon must be less than the max horizon. {horizon} > {fc.max_horizon}.")

      inputs = torch.from_numpy(np.array(inputs)).to(self.model.device).to(torch.float64)
      masks = torch.from_numpy(np.array(masks)).to(self.model.device).to(torch.bool)
      batch_size = inputs.shape[0]

      pf_outputs, quantile_spreads, ar_outputs = self.model.decode(fc.max_horizon, inputs, masks)
      to_cat = [pf_outputs[:, -1, ...]]
      if ar_outputs is not None:
        to_cat.append(ar_outputs.reshape(batch_size, -1, self.model.q))
      full_forecast = torch.cat(to_cat, dim=1)
      full_forecast = full_forecast[:, :horizon, :]

      if fc.fix_quantile_crossing:
        for i in [4, 3, 2, 1]:
          full_forecast[:, :, i] = torch.where(
            full_forecast[:, :, i] < full_forecast[:, :, i + 1],
            full_forecast[:, :, i],
            full_forecast[:, :, i + 1],
          )
        for i in [6, 7, 8, 9]:
          full_forecast[:, :, i] = torch.where(
            full_forecast[:, :, i] > full_forecast[:, :, i - 1],
            full_forecast[:, :, i],
            full_forecast[:, :, i - 1],
          )

      full_forecast = full_forecast.detach().cpu().numpy()
      return full_forecast[..., 5], full_forecast

    self.compiled_decode = _compiled_decode

  def forecast(self, horizon: int, inputs: list) -> tuple:
    """Forecasts the time series."""
    if self.compiled_decode is None:
      raise RuntimeError("Model is not compiled. Please call compile() first.")

    context = self.forecast_config.max_context
    num_inputs = len(inputs)
    if (w := num_inputs % self.global_batch_size) != 0:
      inputs = list(inputs) + [np.array([0.0] * 3)] * (self.global_batch_size - w)

    output_points = []
    output_quantiles = []
    values = []
    masks = []
    idx = 0
    for each_input in inputs:
      value = linear_interpolation(strip_leading_nans(np.array(each_input)))
      if (w := len(value)) >= context:
        value = value[-context:]
        mask = np.zeros_like(value, dtype=bool)
      else:
        mask = np.array([True] * (context - w) + [False] * w)
        value = np.pad(value, (context - w, 0), "constant", constant_values=0.0)
      values.append(value)
      masks.append(mask)
      idx += 1
      if idx == self.global_batch_size:
        idx = 0
        point_forecast, quantile_forecast = self.compiled_decode(horizon, values, masks)
        output_points.append(point_forecast)
        output_quantiles.append(quantile_forecast)
        values = []
        masks = []

    output_points = np.concatenate(output_points, axis=0)
    output_quantiles = np.concatenate(output_quantiles, axis=0)
    return output_points[:num_inputs], output_quantiles[:num_inputs]


# ---------------------------------------------------------------- run + self-check


def randomize_(model: nn.Module) -> None:
  # RMSNorm scales and per-dim scales start at zero upstream (checkpoint values replace
  # them); give them random values so every path carries signal.
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith(".scale") or name.endswith("per_dim_scale"):
        param.copy_(1.0 + 0.3 * torch.randn_like(param))


def main():
  tfm = TimesFM_2p5_torch()
  randomize_(tfm.model)
  tfm.model.eval()
  tfm.compile(ForecastConfig(max_context=30, max_horizon=24, per_core_batch_size=4))
  fc = tfm.forecast_config
  p = tfm.model.p
  assert fc.max_context == 32 and fc.max_horizon == 24

  rng = np.random.default_rng(0)
  t = np.arange(40)
  lengths = [32, 19, 8, 13, 40, 5]  # 40 > max_context: truncated to the last 32 points
  inputs = []
  for k, n in enumerate(lengths):
    series = 3.0 * np.sin(t[:n] / (2.0 + k)) + 0.1 * k * t[:n] + rng.normal(0, 0.3, n) + 10.0 * k
    inputs.append(series)
  inputs[3] = inputs[3].copy()
  inputs[3][:2] = np.nan  # leading NaNs are stripped
  inputs[3][6] = np.nan  # inner NaN is interpolated

  horizon = 20
  point, quantiles = tfm.forecast(horizon, [x.copy() for x in inputs])
  assert point.shape == (len(lengths), horizon) and quantiles.shape == (len(lengths), horizon, 10)

  # Reference 1: each series alone through forecast_naive (no left padding beyond the
  # patch remainder), with the same preprocessing forecast() applies.
  max_err = 0.0
  for k, x in enumerate(inputs):
    value = linear_interpolation(strip_leading_nans(np.array(x)))[-fc.max_context:]
    (ref,) = tfm.model.forecast_naive(fc.max_horizon, [value])
    ref = ref[:horizon]  # (horizon, q)
    err = np.abs(quantiles[k] - ref).max()
    max_err = max(max_err, err)
    assert np.allclose(quantiles[k], ref, atol=1e-9, rtol=1e-9), (k, err)
    assert np.allclose(point[k], ref[:, 5], atol=1e-9, rtol=1e-9), k
  print(f"batched left-padded forecast == per-series forecast_naive: max err {max_err:.2e}")

  # Reference 2: the KV cache.  Re-run the padded batch's decode, keep every step's
  # normalized patches, and recompute the whole patch sequence in one forward without a
  # cache; each step's outputs must equal the no-cache outputs at its patches.
  batch = []
  bmasks = []
  for x in inputs[:4]:
    value = linear_interpolation(strip_leading_nans(np.array(x)))[-fc.max_context:]
    w = len(value)
    bmasks.append(np.array([True] * (fc.max_context - w) + [False] * w))
    batch.append(np.pad(value, (fc.max_context - w, 0), "constant", constant_values=0.0))
  trace = []
  tfm.model.decode(fc.max_horizon, torch.tensor(np.array(batch)), torch.tensor(np.array(bmasks)), trace)
  all_inputs = torch.cat([s[0] for s in trace], dim=1)
  all_masks = torch.cat([s[1] for s in trace], dim=1)
  with torch.no_grad():
    (_, _, full_out, _), _ = tfm.model(all_inputs, all_masks, None)
  start = 0
  cache_err = 0.0
  real = ~all_masks[..., -1]  # padded patches' outputs are never read
  for normed_in, _, out in trace:
    stop = start + normed_in.shape[1]
    keep = real[:, start:stop]
    diff = (out - full_out[:, start:stop])[keep]
    cache_err = max(cache_err, diff.abs().max().item())
    start = stop
  assert cache_err < 1e-9, cache_err
  print(f"decode cache steps == one no-cache forward over all patches: max err {cache_err:.2e}")

  # Reference 3: the first real patch of every series sits at RoPE position 0, so a
  # series padded by whole patches gives the same prefill outputs as the series alone.
  x = torch.tensor(inputs[2])  # 8 points = 2 patches
  padded = torch.cat([torch.zeros(24), x])[None]
  pmask = torch.cat([torch.ones(24, dtype=torch.bool), torch.zeros(8, dtype=torch.bool)])[None]
  alone_pf, _, _ = tfm.model.decode(8, x[None], torch.zeros(1, 8, dtype=torch.bool))
  padded_pf, _, _ = tfm.model.decode(8, padded, pmask)
  assert torch.allclose(alone_pf, padded_pf[:, -2:], atol=1e-10), (alone_pf - padded_pf[:, -2:]).abs().max()
  print("whole-patch left padding leaves the real patches' outputs unchanged")
  print("point forecasts (first 4 steps):")
  for k in range(len(lengths)):
    print(f"  len {lengths[k]:2d}: {np.round(point[k, :4], 3)}")


if __name__ == "__main__":
  main()
