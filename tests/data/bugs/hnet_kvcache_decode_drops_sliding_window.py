"""H-Net `CausalMHA`: the sliding window (`window_size`) is used in training and in the prefill,
but the cached decode step calls `flash_attn_with_kvcache` without it, so generation attends the
whole cache (global attention) in windowed layers.

Citation: goombalab/hnet issue #20, fixed by PR #21 (commit ce712c4, "Pass sliding window size to
flash_attn_with_kvcache during inference"), hnet/modules/mha.py (diff read).

Bug: `CausalMHA.__init__(window_size=...)` handed the window to `FlashCausalSelfAttention` /
`FlashCausalCrossAttention` (training and `seqlen_offset == 0` prefill), but did not keep it, and
`_apply_rotary_update_kvcache_attention` / `_update_kvcache_attention` called
`flash_attn_with_kvcache(..., causal=True)` with the default window (-1, -1).

Fix: `self.window_size = window_size` and `window_size=(self.window_size, -1)` in both
`flash_attn_with_kvcache` calls.

Reproduction: flash-attn is CUDA-only, so `flash_attn_kvpacked_func` and
`flash_attn_with_kvcache` are CPU stand-ins with flash's semantics (causal aligned bottom-right,
`window_size=(left, right)` keeps keys in [i - left, i + right], `cache_seqlens`, K/V appended in
place, rotary applied at the cache offset), computed with F.scaled_dot_product_attention. Two
CausalMHA blocks with window_size 3 and rotary_emb_dim 16 (so decode takes the fused rotary path,
as in H-Net's configs); a 6-token prompt is prefilled, then 3 tokens are decoded with `step()`.
"""
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def _flash_mask(q_len, k_len, causal, window_size):
    i = torch.arange(q_len)[:, None] + (k_len - q_len)  # bottom-right alignment
    j = torch.arange(k_len)[None, :]
    mask = torch.ones(q_len, k_len, dtype=torch.bool)
    left, right = window_size
    if causal:
        right = 0
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def _attn(q, k, v, softmax_scale, causal, window_size):
    """q (B, Sq, H, D), k/v (B, Sk, H, D) -> (B, Sq, H, D)"""
    mask = _flash_mask(q.shape[1], k.shape[1], causal, window_size)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=softmax_scale)
    return out.transpose(1, 2)


def flash_attn_kvpacked_func(q, kv, softmax_scale=None, causal=False, window_size=(-1, -1)):
    return _attn(q, kv[:, :, 0], kv[:, :, 1], softmax_scale, causal, window_size)


def _rotate(x, cos, sin):
    d = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :d], x[..., d:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x_pass], dim=-1)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                            rotary_interleaved=False):
    seqlen = int(cache_seqlens)
    new = k.shape[1]
    if rotary_cos is not None:
        cos = rotary_cos[seqlen : seqlen + new][None]
        sin = rotary_sin[seqlen : seqlen + new][None]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k_cache[:, seqlen : seqlen + new] = k
    v_cache[:, seqlen : seqlen + new] = v
    return _attn(q, k_cache[:, : seqlen + new], v_cache[:, : seqlen + new], softmax_scale, causal, window_size)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0, interleaved=False):
        super().__init__()
        self.dim, self.base, self.interleaved, self.scale = dim, base, interleaved, None
        self._cos_cached = self._sin_cached = None

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float() / self.dim))
        freqs = torch.outer(torch.arange(seqlen).float(), inv_freq)
        self._cos_cached, self._sin_cached = freqs.cos(), freqs.sin()

    def forward(self, qkv, seqlen_offset=0, **kwargs):
        seqlen = qkv.shape[1]
        self._update_cos_sin_cache(seqlen_offset + seqlen)
        cos = self._cos_cached[seqlen_offset : seqlen_offset + seqlen][None]
        sin = self._sin_cached[seqlen_offset : seqlen_offset + seqlen][None]
        q = _rotate(qkv[:, :, 0], cos, sin)
        k = _rotate(qkv[:, :, 1], cos, sin)
        return torch.stack([q, k, qkv[:, :, 2]], dim=2)


class FlashCausalCrossAttention(nn.Module):
    def __init__(self, softmax_scale=None, window_size=(-1, -1)):
        super().__init__()
        self.softmax_scale = softmax_scale
        self.window_size = window_size

    def forward(self, q, kv):
        return flash_attn_kvpacked_func(q, kv, softmax_scale=self.softmax_scale, causal=True,
                                        window_size=(self.window_size, -1))


@dataclass
class InferenceParams:
    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = field(default_factory=dict)
    lengths_per_sample: torch.Tensor = None


def _update_kv_cache(kv, inference_params, layer_idx):
    num_heads, head_dim = kv.shape[-2:]
    if layer_idx not in inference_params.key_value_memory_dict:
        kv_cache = torch.zeros(inference_params.max_batch_size, inference_params.max_seqlen, 2, num_heads, head_dim)
        inference_params.key_value_memory_dict[layer_idx] = kv_cache
    else:
        kv_cache = inference_params.key_value_memory_dict[layer_idx]
    batch_start = inference_params.batch_size_offset
    batch_end = batch_start + kv.shape[0]
    sequence_start = inference_params.seqlen_offset
    sequence_end = sequence_start + kv.shape[1]
    kv_cache[batch_start:batch_end, sequence_start:sequence_end, ...] = kv
    return kv_cache[batch_start:batch_end, :sequence_end, ...]


class CausalMHA(nn.Module):
    def __init__(self, d_model, num_heads, window_size=-1, softmax_scale=None, layer_idx=None,
                 rotary_emb_dim=0, rotary_emb_base=10000.0):
        super().__init__()
        self.d_model, self.layer_idx = d_model, layer_idx
        self.softmax_scale, self.rotary_emb_dim = softmax_scale, rotary_emb_dim
        if FIXED:
            self.window_size = window_size
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        if rotary_emb_dim > 0:
            self.rotary_emb = RotaryEmbedding(rotary_emb_dim, base=rotary_emb_base)
        self.Wqkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.inner_cross_attn = FlashCausalCrossAttention(softmax_scale=softmax_scale, window_size=window_size)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)

    def _apply_rotary_update_kvcache_attention(self, q, kv, inference_params):
        self.rotary_emb._update_cos_sin_cache(inference_params.max_seqlen)
        rotary_cos, rotary_sin = self.rotary_emb._cos_cached, self.rotary_emb._sin_cached
        batch = q.shape[0]
        kv_cache = inference_params.key_value_memory_dict[self.layer_idx][:batch]
        cache_seqlens = inference_params.seqlen_offset
        extra = {"window_size": (self.window_size, -1)} if FIXED else {}
        return flash_attn_with_kvcache(
            q, kv_cache[:, :, 0], kv_cache[:, :, 1], kv[:, :, 0], kv[:, :, 1],
            rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
            softmax_scale=self.softmax_scale, causal=True, rotary_interleaved=False, **extra)

    def forward(self, x, inference_params=None):
        seqlen_offset = 0 if inference_params is None else inference_params.seqlen_offset
        qkv = self.Wqkv(x).unflatten(-1, (3, self.num_heads, self.head_dim))
        if inference_params.seqlen_offset == 0 or (self.rotary_emb_dim == 0 or self.rotary_emb_dim % 16 != 0):
            if self.rotary_emb_dim > 0:
                qkv = self.rotary_emb(qkv, seqlen_offset=seqlen_offset)
            kv = _update_kv_cache(qkv[:, :, 1:], inference_params, self.layer_idx)
            context = self.inner_cross_attn(qkv[:, :, 0], kv)
        else:
            context = self._apply_rotary_update_kvcache_attention(qkv[:, :, 0], qkv[:, :, 1:], inference_params)
        return self.out_proj(context.flatten(-2))

    def step(self, x, inference_params):
        return self.forward(x, inference_params=inference_params)


class Block(nn.Module):
    def __init__(self, d_model, layer_idx):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(d_model), nn.RMSNorm(d_model)
        self.mixer = CausalMHA(d_model, num_heads=2, window_size=3, layer_idx=layer_idx, rotary_emb_dim=16)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))

    def forward(self, x, inference_params):
        x = x + self.mixer(self.norm1(x), inference_params=inference_params)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, d_model=32, n_layer=2):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(Block(d_model, i) for i in range(n_layer))
        self.norm_f = nn.RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, input_ids, inference_params):
        h = self.embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, inference_params)
        return self.lm_head(self.norm_f(h))


@torch.no_grad()
def generate(model, prompt, max_new_tokens):
    inference_params = InferenceParams(max_seqlen=32, max_batch_size=1)
    logits = model(prompt, inference_params)
    inference_params.seqlen_offset += prompt.shape[1]
    out = [int(logits[0, -1].argmax())]
    for _ in range(max_new_tokens - 1):
        logits = model(torch.tensor([[out[-1]]]), inference_params)
        inference_params.seqlen_offset += 1
        out.append(int(logits[0, -1].argmax()))
    return out


if __name__ == "__main__":
    torch.manual_seed(0)
    model = TinyLM().eval()
    prompt = torch.tensor([[3, 17, 29, 8, 41, 12]])
    print("fixed" if FIXED else "buggy", generate(model, prompt, 4))
