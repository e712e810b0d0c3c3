"""TabFM's memory-efficient ("flash") attention kept one query row of the bias per query chunk.

Citation: google-research/tabfm#40 ("Fix silent query-axis mask/bias collapse in memory-efficient
(FLASH) attention"), tabfm/src/jax/memory_efficient_attention.py, read at google-research/tabfm
commit 2fb67e8 (before the fix).

The bug: ``bias_fn`` inside ``dot_product_attention_queries_per_head`` cut each chunk's bias with
``slice_q_len = 1`` (the ``min(bias.shape[-2], query_chunk_size)`` line above it commented out),
so a bias that varies along the query axis was sliced to the first query row of every chunk and
broadcast over the whole chunk. ``MultiheadAttention`` (FLASH impl, the default for the column
and ICL layers) accepts a ``[B, #N, #T, T_src]`` boolean mask and turns it into that bias.

The fix: ``slice_q_len = min(bias.shape[-2], query_chunk_size)`` and
``slice_k_len = min(bias.shape[-1], key_chunk_size)``.

Ported from JAX/NNX to torch, names and layout kept (``_summarize_chunk``,
``_memory_efficient_attention``, ``bias_fn`` with a ``lax.dynamic_slice`` stand-in that clamps its
start indices the way XLA does, ``dot_product_attention_multihead``, ``MultiheadAttention`` with
per-head RMSNorm on q/k and ``PerDimScale``, the pre/post-norm ``MultiheadAttentionBlock``).
Tiny sizes, float32, random weights. The ICL step hands the attention a mask that varies per query
row, as TabPFN (v1) lays out an in-context batch: every row sees the training rows, and each test
row also sees itself.
"""

import dataclasses
import sys
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


# ---- memory_efficient_attention.py --------------------------------------------------------------
def _causal_bias(q_len, k_len, offset=None, mask_to_bias_factor=1e6):
  q_idxs = torch.arange(q_len, dtype=torch.int32)[:, None]
  k_idxs = torch.arange(k_len, dtype=torch.int32)[None, :]
  if offset is not None:
    q_idxs = q_idxs + offset
  inverted_mask = q_idxs < k_idxs
  return inverted_mask * (-1 * mask_to_bias_factor)


def _local_causal_bias(q_len, k_len, query_offset, key_offset):
  offset = query_offset - key_offset
  return _causal_bias(q_len, k_len, offset=offset)


def _dynamic_slice(operand, start_indices, slice_sizes):
  """lax.dynamic_slice: start indices are clamped so that the slice stays in bounds."""
  index = []
  for start, size, dim in zip(start_indices, slice_sizes, operand.shape):
    start = max(0, min(int(start), dim - size))
    index.append(slice(start, start + size))
  return operand[tuple(index)]


class _AttentionSummary(NamedTuple):
  numerator: torch.Tensor  # B T N G E
  denominator: torch.Tensor  # B T N G
  max_so_far: torch.Tensor  # B T N G


def _summarize_chunk(query, key, value, current_summary, bias):
  batch, q_len, q_heads, queries_per_head, q_feat = query.shape
  del q_feat
  _, kv_len, _, v_feat = value.shape
  ref_dtype = value.dtype

  (numerator, denominator, max_so_far) = current_summary

  attn_weights = torch.einsum('bqhnd,bkhd->bqhnk', query, key)

  if bias is not None:
    bias = torch.movedim(bias, -2, 1)  # move sequence length outside
    attn_weights = attn_weights + bias

  previous_max = max_so_far
  chunk_maxima = attn_weights.amax(dim=-1)
  max_so_far = torch.maximum(max_so_far, chunk_maxima).detach()
  correction = torch.exp(previous_max - max_so_far)

  corrected_weights = torch.exp(attn_weights - max_so_far[:, :, :, :, None])

  numerator = numerator * correction[:, :, :, :, None]
  numerator = numerator + torch.einsum('bqhnv,bvhf->bqhnf', corrected_weights, value)

  denominator = denominator * correction
  denominator = denominator + corrected_weights.sum(dim=-1)

  return _AttentionSummary(
      numerator.to(ref_dtype), denominator.to(ref_dtype), max_so_far.to(ref_dtype)
  )


def _memory_efficient_attention(
    query, key, value, bias_fn: Callable[[int, int], torch.Tensor], query_chunk_size,
    key_chunk_size, dtype=torch.float32, use_extra_logit=False, causal_mask=False,
):
  batch, num_q, heads, queries_per_head, q_feat = query.shape
  batch, num_kv, heads, k_features = key.shape
  batch, num_kv, heads, v_features = value.shape

  num_q_chunks = num_q // query_chunk_size
  num_kv_chunks = num_kv // key_chunk_size

  query = query.reshape(batch, num_q_chunks, query_chunk_size, heads, queries_per_head, q_feat)
  key = key.reshape(batch, num_kv_chunks, key_chunk_size, heads, k_features)
  value = value.reshape(batch, num_kv_chunks, key_chunk_size, heads, v_features)
  query = torch.movedim(query, 1, 0)
  key = torch.movedim(key, 1, 0)
  value = torch.movedim(value, 1, 0)

  zero_chunk = _AttentionSummary(
      torch.zeros(batch, query_chunk_size, heads, queries_per_head, v_features, dtype=dtype),
      torch.zeros(batch, query_chunk_size, heads, queries_per_head, dtype=dtype),
      -torch.inf * torch.ones(batch, query_chunk_size, heads, queries_per_head, dtype=dtype),
  )

  def _query_chunk_attention(query_chunk, query_chunk_idx):
    carry = zero_chunk
    for key_chunk_idx in range(num_kv_chunks):  # jax.lax.scan
      skip_block = False
      if causal_mask:
        skip_block = query_chunk_idx < key_chunk_idx
      if skip_block:
        continue
      chunk_bias = bias_fn(query_chunk_idx, key_chunk_idx)
      carry = _summarize_chunk(
          query_chunk, key[key_chunk_idx], value[key_chunk_idx], carry, chunk_bias
      )
    numerator, denominator, max_so_far = carry
    if use_extra_logit:
      denominator = denominator + torch.exp(-max_so_far)
    return numerator / denominator[:, :, :, :, None]

  res = torch.stack(
      [_query_chunk_attention(query[i], i) for i in range(num_q_chunks)]  # lax.map
  )
  res = torch.movedim(res, 0, 1)
  return res.reshape(batch, num_q, heads, queries_per_head, value.shape[-1])


def dot_product_attention_queries_per_head(
    query, key, value, bias=None, dtype=torch.float32, use_extra_logit=False,
    causal_mask=False, query_chunk_size=1024, key_chunk_size=2048,
):
  orig_batch_dims = query.shape[:-4]
  query = query.reshape(-1, *query.shape[-4:])
  key = key.reshape(-1, *key.shape[-3:])
  value = value.reshape(-1, *value.shape[-3:])
  if bias is not None:
    bias = bias.reshape(-1, *bias.shape[-4:])

  batch_size, query_length, heads, queries_per_head, _ = query.shape
  _, key_length, _, _ = key.shape

  if bias is not None:
    broadcastable_to = (batch_size, heads, queries_per_head, query_length, key_length)
    for bias_dim, broadcast_dim in zip(bias.shape, broadcastable_to):
      if bias_dim not in [1, broadcast_dim]:
        raise ValueError(
            f'Expected bias dimensions {bias.shape} to be broadcastable to'
            f' {broadcastable_to}.'
        )

  def bias_fn(query_chunk_idx, key_chunk_idx):
    query_offset = query_chunk_idx * query_chunk_size
    key_offset = key_chunk_idx * key_chunk_size

    local_bias = torch.zeros((1, 1, 1, 1, 1), dtype=dtype)
    if bias is not None:
      # If bias is not broadcasted yet, dynamic slice would fail with full slice
      # size. In this case we keep the bias unbroadcasted.
      if FIXED:
        slice_q_len = min(bias.shape[-2], query_chunk_size)
        slice_k_len = min(bias.shape[-1], key_chunk_size)
      else:
        # slice_q_len = min(bias.shape[-2], query_chunk_size)
        # slice_k_len = min(bias.shape[-1], key_chunk_size)
        slice_q_len = 1
        slice_k_len = key_chunk_size

      local_bias = _dynamic_slice(
          bias,
          start_indices=(0, 0, 0, query_offset, key_offset),
          slice_sizes=(*bias.shape[:3], slice_q_len, slice_k_len),
      )
    if causal_mask:
      causal = _local_causal_bias(query_chunk_size, key_chunk_size, query_offset, key_offset)
      local_bias = local_bias + causal.reshape(1, 1, 1, *causal.shape)
    return local_bias

  result = _memory_efficient_attention(
      query, key, value, bias_fn,
      query_chunk_size=query_chunk_size, key_chunk_size=key_chunk_size,
      dtype=dtype, use_extra_logit=use_extra_logit, causal_mask=causal_mask,
  )
  return result.reshape(*orig_batch_dims, *result.shape[1:])


def dot_product_attention_multihead(
    query, key, value, bias=None, dtype=torch.float32, causal_mask=False,
    query_chunk_size=1024, key_chunk_size=2048,
):
  query = query.unsqueeze(-2)  # queries_per_head
  if bias is not None:
    bias = bias.unsqueeze(-3)  # add num_heads, treat current num_heads dim as queries_per_head
  result = dot_product_attention_queries_per_head(
      query, key, value, bias, dtype=dtype, causal_mask=causal_mask,
      query_chunk_size=query_chunk_size, key_chunk_size=key_chunk_size,
  )
  return result.squeeze(-2)  # remove queries_per_head dim


# ---- model.py -----------------------------------------------------------------------------------
class PerDimScale(nn.Module):

  def __init__(self, num_dims):
    super().__init__()
    self.num_dims = num_dims
    self.per_dim_scale = nn.Parameter(torch.zeros(num_dims))

  def forward(self, x):
    return x * (1.442695041 / self.num_dims ** 0.5 * F.softplus(self.per_dim_scale)).to(x.dtype)


class MultiheadAttention(nn.Module):

  def __init__(self, embed_dim, num_heads, attention_impl='flash', use_bias=True):
    super().__init__()
    self.embed_dim = embed_dim
    self.num_heads = num_heads
    self.head_dim = embed_dim // num_heads
    self.attention_impl = attention_impl
    self.out_proj = nn.Linear(embed_dim, embed_dim, bias=use_bias)
    self.q_proj = nn.Linear(embed_dim, embed_dim, bias=use_bias)
    self.k_proj = nn.Linear(embed_dim, embed_dim, bias=use_bias)
    self.v_proj = nn.Linear(embed_dim, embed_dim, bias=use_bias)
    self.query_ln = nn.RMSNorm(self.head_dim, eps=1e-6)
    self.key_ln = nn.RMSNorm(self.head_dim, eps=1e-6)
    self.per_dim_scale = PerDimScale(self.head_dim)

  def forward(self, query, key, value, attn_mask=None):
    batch_size, tgt_len, _ = query.shape
    dtype = query.dtype
    if attn_mask is not None:
      assert attn_mask.shape[0] == batch_size

    q = self.q_proj(query).reshape(batch_size, tgt_len, self.num_heads, self.head_dim)
    src_len = key.shape[-2]
    k = self.k_proj(key).reshape(batch_size, src_len, self.num_heads, self.head_dim)
    v = self.v_proj(value).reshape(batch_size, src_len, self.num_heads, self.head_dim)

    q = self.query_ln(q)
    k = self.key_ln(k)
    q = self.per_dim_scale(q)

    if attn_mask is not None:
      assert attn_mask.ndim == 4, 'attn_mask must be 4D'
      assert attn_mask.shape[-3] == 1

    if self.attention_impl == 'flash':
      attention_bias = None
      if attn_mask is not None:
        attention_bias = torch.where(attn_mask, 0.0, -1e30)
      attn_output = dot_product_attention_multihead(
          query=q, key=k, value=v, bias=attention_bias, dtype=dtype,
          query_chunk_size=128 if tgt_len >= 128 else tgt_len,
          key_chunk_size=128 if src_len >= 128 else src_len,
      )
    else:
      raise ValueError('Unsupported attention implementation: %s' % self.attention_impl)

    flat_output = attn_output.reshape(batch_size, tgt_len, self.embed_dim)
    return self.out_proj(flat_output)


class MultiheadAttentionBlock(nn.Module):

  def __init__(self, d_model, nhead, dim_feedforward, attention_impl='flash', use_bias=True):
    super().__init__()
    self.attn = MultiheadAttention(d_model, nhead, attention_impl=attention_impl)
    self.pre_attn_ln = nn.RMSNorm(d_model, eps=1e-6)
    self.post_attn_ln = nn.RMSNorm(d_model, eps=1e-6)
    self.pre_ff_ln = nn.RMSNorm(d_model, eps=1e-6)
    self.post_ff_ln = nn.RMSNorm(d_model, eps=1e-6)
    self.activation = nn.GELU()
    self.linear1 = nn.Linear(d_model, dim_feedforward, bias=use_bias)
    self.linear2 = nn.Linear(dim_feedforward, d_model, bias=use_bias)

  def _ff_block(self, x):
    x = self.pre_ff_ln(x)
    x = self.linear2(self.activation(self.linear1(x)))
    return self.post_ff_ln(x)

  def forward(self, q, k=None, v=None, attn_mask=None):
    x = q
    q_n = self.pre_attn_ln(q)
    k = q if k is None else k
    v = q if v is None else v
    k_n = self.pre_attn_ln(k)
    v_n = self.pre_attn_ln(v)
    attn_out = self.attn(query=q_n, key=k_n, value=v_n, attn_mask=attn_mask)
    attn_out = self.post_attn_ln(attn_out)
    x = x + attn_out
    x = x + self._ff_block(x)
    return x


class Encoder(nn.Module):

  def __init__(self, num_blocks, d_model, nhead, dim_feedforward, attention_impl='flash'):
    super().__init__()
    self.blocks = nn.ModuleList(
        [MultiheadAttentionBlock(d_model, nhead, dim_feedforward, attention_impl)
         for _ in range(num_blocks)]
    )

  def forward(self, src, attn_mask=None):
    out = src
    for block in self.blocks:  # nnx.scan over stacked blocks
      out = block(out, attn_mask=attn_mask)
    return out


class OneHotAndLinear(nn.Module):

  def __init__(self, num_classes, embed_dim):
    super().__init__()
    self.num_classes = num_classes
    self.linear = nn.Linear(num_classes, embed_dim)

  def forward(self, src):
    return self.linear(F.one_hot(src, self.num_classes).float())


@dataclasses.dataclass
class Config:
  embed_dim: int = 32
  icl_num_blocks: int = 2
  icl_nhead: int = 4
  ff_factor: int = 2
  max_classes: int = 3
  icl_attention_impl: str = 'flash'


class ICLearning(nn.Module):

  def __init__(self, config: Config):
    super().__init__()
    d = config.embed_dim
    self.y_encoder = OneHotAndLinear(config.max_classes, d)
    self.tf_icl = Encoder(config.icl_num_blocks, d, config.icl_nhead, d * config.ff_factor,
                          config.icl_attention_impl)
    self.ln = nn.RMSNorm(d, eps=1e-6)
    self.decoder = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, config.max_classes))

  def forward(self, R, y, train_size):
    y_encoded = self.y_encoder(y.long())
    B, sequence_length, _ = R.shape
    positions = torch.arange(sequence_length)
    train_mask = positions[None, :] < train_size[:, None]  # (B, T)
    y_encoded = y_encoded * train_mask.reshape(B, sequence_length, 1)
    R = R + y_encoded
    # Each row sees the training rows; a test row also sees itself.
    is_self = positions[:, None] == positions[None, :]  # (T, T)
    is_test_row = ~train_mask[:, :, None]  # (B, T, 1)
    full_attn_mask = train_mask[:, None, :] | (is_test_row & is_self[None])  # (B, T, T)
    full_attn_mask = full_attn_mask[:, None, :, :]  # (B, 1, T, T)
    result = self.tf_icl(R, attn_mask=full_attn_mask)
    result = self.ln(result)
    return self.decoder(result)


def main():
  torch.manual_seed(0)
  config = Config()
  model = ICLearning(config).eval()

  B, T = 2, 18
  train_size = torch.tensor([12, 10])
  R = torch.randn(B, T, config.embed_dim)
  y = torch.randint(0, config.max_classes, (B, T))

  with torch.no_grad():
    logits = model(R, y, train_size)
  probs = logits.softmax(-1)
  for b in range(B):
    test = probs[b, int(train_size[b]):]
    print(f'table {b}: test-row class probabilities')
    print(test.numpy().round(4))
    print('  predicted:', test.argmax(-1).tolist())


if __name__ == '__main__':
  main()
