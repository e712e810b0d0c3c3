"""jax.nn.dot_product_attention (XLA path), ported to torch: `local_window_size` had no effect
unless a mask, `is_causal` or sequence lengths were also given.

Citation: jax-ml/jax#32300 ("jax.nn.dot_product_attention ignores local_window_size when mask is
not present"), fixed by jax-ml/jax#32357 (commit 099f0a1, merged as f837ebc).  Ported from
jax/_src/nn/functions.py at 099f0a1^: `dot_product_attention` (int window -> symmetric tuple,
`_ensure_4d`, the `implementation=None` fallback to XLA), `_dot_product_attention_xla` (grouped
heads, vmapped over the group axis), `_dot_product_attention_core`, `_apply_masks`,
`_get_window_mask`, `_get_causal_mask`, `_get_padding_mask_logits`, `_get_large_negative`.
Layout is JAX's: query [B, T, N, H], key/value [B, S, K, H], masks True = keep.

Bug: `_apply_masks` returned the logits untouched when `mask is None and not is_causal and
q_seqlen is None and kv_seqlen is None`; `local_window_size` was not part of that test, so a
bidirectional local-attention layer called with no mask attended over the whole sequence.
Fix: add `and local_window_size is None` to the early-return condition.

Caller: a small bidirectional local-attention encoder (grouped-query, window +-2) over an
unpadded batch of equal-length frame sequences, calling the function as the issue does:
`dot_product_attention(q, k, v, mask=None, local_window_size=2)`.
"""
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- jax/_src/nn/functions.py
def _get_large_negative(dtype):
    dtype_max = torch.finfo(dtype).max
    return torch.tensor(-0.7 * dtype_max, dtype=dtype)


def _get_causal_mask(T, S):
    mask = torch.tril(torch.ones((T, S), dtype=torch.bool))
    return mask[None, None, :, :]


def _get_window_mask(T, S, local_window_size):
    query_pos = torch.arange(T)
    key_pos = torch.arange(S)
    left_window, right_window = local_window_size
    left_mask = query_pos[..., None] <= key_pos[..., None, :] + left_window
    right_mask = query_pos[..., None] >= key_pos[..., None, :] - right_window
    return torch.logical_and(right_mask, left_mask)[None, None, :, :]


def _get_padding_mask_logits(T, S, q_seqlen, kv_seqlen):
    q_mask = torch.tensor(True)
    kv_mask = torch.tensor(True)
    if q_seqlen is not None:
        q_indices = torch.arange(0, T)[None, :, None]
        q_mask = q_indices < q_seqlen[:, None, None]
    if kv_seqlen is not None:
        kv_indices = torch.arange(0, S)[None, None, :]
        kv_mask = kv_indices < kv_seqlen[:, None, None]
    mask = torch.logical_and(q_mask, kv_mask)
    return mask[:, None, :, :]


def _get_padding_mask_encoded(T, q_seqlen):
    q_indices = torch.arange(0, T)[None, :]
    mask = q_indices < q_seqlen[:, None]
    return mask[:, :, None, None]


def _apply_masks(logits, mask, is_causal, q_seqlen, kv_seqlen, local_window_size):
    if FIXED:
        if (mask is None and not is_causal and q_seqlen is None and kv_seqlen is None
                and local_window_size is None):
            return logits
    else:
        if mask is None and not is_causal and q_seqlen is None and kv_seqlen is None:
            return logits

    combined_mask = torch.ones_like(logits, dtype=torch.bool)
    if mask is not None:
        assert mask.dtype == torch.bool
        combined_mask = torch.logical_and(combined_mask, mask)

    T, S = logits.shape[2], logits.shape[3]

    if is_causal:
        mask = _get_causal_mask(T, S)
        combined_mask = torch.logical_and(combined_mask, mask)

    if local_window_size is not None:
        mask = _get_window_mask(T, S, local_window_size)
        combined_mask = torch.logical_and(combined_mask, mask)

    if q_seqlen is not None or kv_seqlen is not None:
        mask = _get_padding_mask_logits(T, S, q_seqlen, kv_seqlen)
        combined_mask = torch.logical_and(combined_mask, mask)

    large_negative_number = _get_large_negative(logits.dtype)
    padded_logits = torch.where(combined_mask, logits, large_negative_number)
    return padded_logits


def _dot_product_attention_core(query, key, value, bias, mask, is_causal,
                                scale, q_seqlen, kv_seqlen, local_window_size):
    # query [B, T, N, H] (one group slice), key/value [B, S, N, H]
    logits = torch.einsum("BTNH,BSNH->BNTS", query.float(), key.float())
    logits = logits * scale

    if bias is not None:
        logits = (logits + bias).to(logits.dtype)

    padded_logits = _apply_masks(logits, mask, is_causal, q_seqlen, kv_seqlen,
                                 local_window_size)

    # Softmax and it is always carried out in fp32.
    padded_logits = padded_logits.float()
    probs = torch.softmax(padded_logits, dim=-1).to(key.dtype)

    encoded = torch.einsum("BNTS,BSNH->BTNH", probs, value)
    if q_seqlen is not None:
        mask = _get_padding_mask_encoded(encoded.shape[1], q_seqlen)
        encoded = encoded * mask.to(encoded.dtype)
    return encoded


def _dot_product_attention_xla(query, key, value, bias, mask, is_causal, scale,
                               q_seqlen, kv_seqlen, local_window_size):
    B, T, N, H = query.shape
    _, S, K, _ = key.shape
    G = N // K

    query = torch.reshape(query, (B, T, K, G, H))

    def _reshape_to_grouped(t):
        if t is not None:
            tB, tN, tT, tS = t.shape
            if tN == 1:
                t = torch.broadcast_to(t[:, :, None, :, :], (tB, tN, G, tT, tS))
            else:
                assert tN == N
                t = torch.reshape(t, (tB, K, G, tT, tS))
        return t

    bias = _reshape_to_grouped(bias)
    mask = _reshape_to_grouped(mask)
    # vmap(_dot_product_attention_core, in_axes=(3, None, None, 2, 2, ...), out_axes=3)
    outs = []
    for g in range(G):
        outs.append(_dot_product_attention_core(
            query[:, :, :, g], key, value,
            None if bias is None else bias[:, :, g],
            None if mask is None else mask[:, :, g],
            is_causal, scale, q_seqlen, kv_seqlen, local_window_size))
    encoded = torch.stack(outs, dim=3)
    encoded = torch.reshape(encoded, (B, T, N, H))
    return encoded


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          implementation=None):
    output_shape = query.shape

    def _ensure_4d(t):
        dims_to_add = 4 - t.ndim
        for _ in range(dims_to_add):
            t = t.unsqueeze(0)
        return t

    query_arr = _ensure_4d(query)
    key_arr = _ensure_4d(key)
    value_arr = _ensure_4d(value)
    bias = _ensure_4d(bias) if bias is not None else None
    mask = _ensure_4d(mask) if mask is not None else None
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)

    B, S, K, H = key_arr.shape
    if query_arr.shape[-2] % K != 0:
        raise ValueError("The number of query heads must be a multiple of key/value heads")

    scale_val = (1.0 / np.sqrt(H)) if scale is None else scale

    if implementation in ("xla", None):
        out = _dot_product_attention_xla(
            query_arr, key_arr, value_arr, bias, mask, is_causal=is_causal,
            scale=scale_val, q_seqlen=query_seq_lengths,
            kv_seqlen=key_value_seq_lengths,
            local_window_size=local_window_size,
        )
    else:
        raise ValueError(f"Unsupported implementation option: {implementation}")
    return torch.reshape(out, output_shape)


# ---------------------------------------------------------------- a local-attention encoder
@dataclass
class EncoderConfig:
    d_model: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    num_layers: int = 2
    local_window_size: int = 2   # each frame sees +-2 neighbours


class LocalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.d_model, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x, mask=None):
        B, T, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).reshape(B, T, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        out = dot_product_attention(q, k, v, mask=mask,
                                    local_window_size=cfg.local_window_size)
        return self.o_proj(out.reshape(B, T, cfg.num_heads * cfg.head_dim))


class EncoderBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = LocalSelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x, mask=None):
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.mlp(self.norm2(x))


class LocalEncoder(nn.Module):
    def __init__(self, cfg, in_dim=12):
        super().__init__()
        self.embed = nn.Linear(in_dim, cfg.d_model)
        self.blocks = nn.ModuleList([EncoderBlock(cfg) for _ in range(cfg.num_layers)])
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(self, frames):
        x = self.embed(frames)
        for blk in self.blocks:
            x = blk(x)   # equal-length clips: no padding, so no mask
        return self.norm(x)


def main():
    torch.manual_seed(0)
    cfg = EncoderConfig()
    model = LocalEncoder(cfg).eval()
    frames = torch.randn(2, 10, 12)   # two clips of 10 frames each
    with torch.no_grad():
        feats = model(frames)
        # per-frame features feed a frame classifier; report the first and last frames
        print("features:", tuple(feats.shape))
        print("frame 0   [:4]:", [round(v, 4) for v in feats[0, 0, :4].tolist()])
        print("frame -1  [:4]:", [round(v, 4) for v in feats[0, -1, :4].tolist()])
        print("mean |feat|: %.6f" % feats.abs().mean().item())


if __name__ == "__main__":
    main()
