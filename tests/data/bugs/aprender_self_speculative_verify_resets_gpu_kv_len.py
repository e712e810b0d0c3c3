"""realizar (paiml/aprender) self-speculative CUDA decode: verification runs over a reset KV cache.

Citation: paiml/aprender#2014 ("fix(serve): speculative decode - roll back GPU KV-cache for
verification, not reset (PMAT-752)"); code: ``OwnedQuantizedModelCuda::generate_speculative_cuda``
(speculative decoding methods for CUDA-accelerated inference) and ``CudaExecutor``'s
``reset_kv_cache_gpu`` / ``rollback_kv_cache_gpu`` / ``flash_attention_cached``.

The bug: after drafting k tokens, the self-speculative path rolled the host-side cache back to the
pre-draft snapshot (``cache.rollback_to(cache_snapshot, kv_dim)``) but called
``self.executor.reset_kv_cache_gpu()``, which sets every layer's GPU KV length to 0. The verify
forwards that follow append their K/V at slot 0 and attend only over what was appended since the
reset, so the prompt and the accepted history drop out of every verification (and of every later
draft), while RoPE positions keep counting from the true position. Same in the all-rejected
fallback.

The fix: ``self.executor.rollback_kv_cache_gpu(cache_snapshot)`` in both places, keeping the GPU KV
length in step with the host snapshot (as the two-model path PAR-099/PAR-105 already did).

Ported from Rust/CUDA to torch at toy sizes with random weights: the executor holds per-layer K/V
buffers keyed ``kv_{layer}_k`` / ``kv_{layer}_v`` and a per-layer length; each single-token forward
writes its K/V at that length and attends over the first ``length`` entries.
"""

import dataclasses
import sys
from typing import Dict, List

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclasses.dataclass
class QuantizedModelConfig:
    vocab_size: int = 64
    hidden_dim: int = 32
    intermediate_dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    rope_theta: float = 10000.0
    eps: float = 1e-5


@dataclasses.dataclass
class QuantizedGenerateConfig:
    max_tokens: int = 12
    stop_tokens: tuple = ()


class CudaExecutor:
    """Torch stand-in for realizar's CudaExecutor KV-cache state."""

    def __init__(self):
        self.kv_cache_gpu: Dict[str, torch.Tensor] = {}
        self.kv_cache_lengths: Dict[int, int] = {}
        self.kv_num_heads = 0
        self.kv_num_kv_heads = 0
        self.kv_head_dim = 0
        self.rope_theta = 10000.0

    def init_kv_cache_gpu(self, num_layers, num_heads, num_kv_heads, head_dim, max_len):
        self.kv_num_heads = num_heads
        self.kv_num_kv_heads = num_kv_heads
        self.kv_head_dim = head_dim
        kv_dim = num_kv_heads * head_dim
        for layer_idx in range(num_layers):
            self.kv_cache_gpu[f"kv_{layer_idx}_k"] = torch.zeros(max_len, kv_dim)
            self.kv_cache_gpu[f"kv_{layer_idx}_v"] = torch.zeros(max_len, kv_dim)
            self.kv_cache_lengths[layer_idx] = 0

    def kv_cache_len(self, layer_idx):
        return self.kv_cache_lengths.get(layer_idx, 0)

    def reset_kv_cache_gpu(self):
        """Clear KV cache for a new generation (reset sequence position to 0)."""
        for layer_idx in self.kv_cache_lengths:
            self.kv_cache_lengths[layer_idx] = 0

    def rollback_kv_cache_gpu(self, position):
        """PAR-105: Rollback KV cache to a specific position (for speculative decode)."""
        for layer_idx, length in self.kv_cache_lengths.items():
            if length > position:
                self.kv_cache_lengths[layer_idx] = position

    def set_rope_theta(self, theta):
        self.rope_theta = theta

    def flash_attention_cached(self, layer_idx, q, k, v):
        """Append k/v at the layer's current length and attend q over the cached prefix."""
        cache_len = self.kv_cache_lengths[layer_idx]
        k_buf = self.kv_cache_gpu[f"kv_{layer_idx}_k"]
        v_buf = self.kv_cache_gpu[f"kv_{layer_idx}_v"]
        k_buf[cache_len] = k
        v_buf[cache_len] = v
        total_len = cache_len + 1
        self.kv_cache_lengths[layer_idx] = total_len

        nh, nkv, hd = self.kv_num_heads, self.kv_num_kv_heads, self.kv_head_dim
        qh = q.view(nh, 1, hd)
        kh = k_buf[:total_len].view(total_len, nkv, hd).transpose(0, 1)
        vh = v_buf[:total_len].view(total_len, nkv, hd).transpose(0, 1)
        group = nh // nkv
        kh = kh.repeat_interleave(group, dim=0)
        vh = vh.repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0))
        return out.reshape(nh * hd)


class OwnedQuantizedKVCache:
    """Host-side cache bookkeeping (k/v per layer plus a length)."""

    def __init__(self, num_layers, kv_dim, max_len):
        self.k = [torch.zeros(max_len, kv_dim) for _ in range(num_layers)]
        self.v = [torch.zeros(max_len, kv_dim) for _ in range(num_layers)]
        self.seq_len = 0
        self.max_len = max_len

    def snapshot_len(self):
        return self.seq_len

    def rollback_to(self, length, kv_dim):
        if length < self.seq_len:
            for layer_k, layer_v in zip(self.k, self.v):
                layer_k[length:, :kv_dim] = 0.0
                layer_v[length:, :kv_dim] = 0.0
            self.seq_len = length

    def advance(self):
        self.seq_len += 1


def apply_rope_norm(x, position, num_heads, head_dim, theta):
    """RoPE NORM type (adjacent pairs), one token at `position`."""
    x = x.view(num_heads, head_dim // 2, 2)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = position * inv_freq
    cos, sin = ang.cos(), ang.sin()
    x0, x1 = x[..., 0], x[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.reshape(num_heads * head_dim)


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean() + eps) * w


class OwnedQuantizedModel:
    def __init__(self, config: QuantizedModelConfig, seed=0):
        g = torch.Generator().manual_seed(seed)
        c = config
        self.config = c
        head_dim = c.hidden_dim // c.num_heads
        kv_dim = c.num_kv_heads * head_dim

        def w(*shape, scale=0.3):
            return torch.randn(*shape, generator=g) * scale

        self.token_embedding = w(c.vocab_size, c.hidden_dim, scale=1.0)
        self.layers = []
        for _ in range(c.num_layers):
            self.layers.append(
                dict(
                    attn_norm=torch.ones(c.hidden_dim),
                    q=w(c.hidden_dim, c.hidden_dim),
                    k=w(kv_dim, c.hidden_dim),
                    v=w(kv_dim, c.hidden_dim),
                    o=w(c.hidden_dim, c.hidden_dim),
                    ffn_norm=torch.ones(c.hidden_dim),
                    gate=w(c.intermediate_dim, c.hidden_dim),
                    up=w(c.intermediate_dim, c.hidden_dim),
                    down=w(c.hidden_dim, c.intermediate_dim),
                )
            )
        self.output_norm = torch.ones(c.hidden_dim)
        self.lm_head = w(c.vocab_size, c.hidden_dim)


class OwnedQuantizedModelCuda:
    def __init__(self, model: OwnedQuantizedModel):
        self.model = model
        self.executor = CudaExecutor()
        c = model.config
        self._max_len = 256
        self.executor.init_kv_cache_gpu(
            c.num_layers, c.num_heads, c.num_kv_heads, c.hidden_dim // c.num_heads, self._max_len
        )
        self.executor.set_rope_theta(c.rope_theta)

    def supports_gpu_resident(self):
        return True

    def preload_weights_gpu(self):
        return sum(p.numel() * 4 for layer in self.model.layers for p in layer.values())

    @torch.no_grad()
    def forward_gpu_resident(self, token_id, cache: OwnedQuantizedKVCache, position):
        c = self.model.config
        head_dim = c.hidden_dim // c.num_heads
        x = self.model.token_embedding[token_id].clone()
        for layer_idx, layer in enumerate(self.model.layers):
            h = rms_norm(x, layer["attn_norm"], c.eps)
            q = layer["q"] @ h
            k = layer["k"] @ h
            v = layer["v"] @ h
            q = apply_rope_norm(q, position, c.num_heads, head_dim, self.executor.rope_theta)
            k = apply_rope_norm(k, position, c.num_kv_heads, head_dim, self.executor.rope_theta)
            if cache.seq_len < cache.max_len:
                cache.k[layer_idx][cache.seq_len] = k
                cache.v[layer_idx][cache.seq_len] = v
            attn = self.executor.flash_attention_cached(layer_idx, q, k, v)
            x = x + layer["o"] @ attn
            h = rms_norm(x, layer["ffn_norm"], c.eps)
            x = x + layer["down"] @ (F.silu(layer["gate"] @ h) * (layer["up"] @ h))
        cache.advance()
        x = rms_norm(x, self.model.output_norm, c.eps)
        return self.model.lm_head @ x

    def forward_gpu_resident_to_token_id(self, token_id, cache, position):
        logits = self.forward_gpu_resident(token_id, cache, position)
        return int(torch.argmax(logits).item())

    def generate_speculative_cuda(
        self, prompt: List[int], config: QuantizedGenerateConfig, speculation_k: int
    ) -> List[int]:
        """PAR-100: Self-speculative decoding (same model drafts and verifies)."""
        if not prompt:
            return []
        if not self.supports_gpu_resident():
            raise RuntimeError("Model architecture not supported for GPU-resident path")

        self.preload_weights_gpu()

        num_kv_heads = self.model.config.num_kv_heads
        head_dim = self.model.config.hidden_dim // self.model.config.num_heads
        kv_dim = num_kv_heads * head_dim
        cache = OwnedQuantizedKVCache(
            self.model.config.num_layers,
            kv_dim,
            len(prompt) + config.max_tokens + speculation_k,
        )

        # Reset GPU KV cache positions before generation
        self.executor.reset_kv_cache_gpu()

        tokens = list(prompt)

        # Prefill: process prompt tokens using GPU-resident path
        for pos, token_id in enumerate(prompt):
            if pos < len(prompt) - 1:
                self.forward_gpu_resident(token_id, cache, pos)

        # Start decode from last prompt token
        position = len(prompt) - 1
        last_token = prompt[-1]

        accepted_tokens = 0
        total_drafts = 0
        total_speculative_batches = 0

        while len(tokens) - len(prompt) < config.max_tokens:
            # Step 1: Draft k tokens greedily using GPU-resident forward
            cache_snapshot = cache.snapshot_len()
            draft_tokens = []

            for i in range(speculation_k):
                draft_pos = position + i
                input_token = last_token if i == 0 else draft_tokens[-1]
                draft = self.forward_gpu_resident_to_token_id(input_token, cache, draft_pos)
                if draft in config.stop_tokens:
                    if i == 0:
                        tokens.append(draft)
                    break
                draft_tokens.append(draft)

            if not draft_tokens:
                break

            total_drafts += len(draft_tokens)

            # Step 2: Rollback cache to snapshot for verification
            cache.rollback_to(cache_snapshot, kv_dim)
            if FIXED:
                self.executor.rollback_kv_cache_gpu(cache_snapshot)
            else:
                self.executor.reset_kv_cache_gpu()

            # Step 3: Verify - use single-token GPU-resident to check each draft
            num_accepted = 0
            for i, draft in enumerate(draft_tokens):
                verify_pos = position + i
                input_token = last_token if i == 0 else draft_tokens[i - 1]
                verified = self.forward_gpu_resident_to_token_id(input_token, cache, verify_pos)
                if verified == draft:
                    tokens.append(draft)
                    num_accepted += 1
                else:
                    if verified not in config.stop_tokens:
                        tokens.append(verified)
                        num_accepted += 1
                    break

            total_speculative_batches += 1

            # Handle edge case: all drafts rejected
            if num_accepted == 0 and draft_tokens:
                cache.rollback_to(cache_snapshot, kv_dim)
                if FIXED:
                    self.executor.rollback_kv_cache_gpu(cache_snapshot)
                else:
                    self.executor.reset_kv_cache_gpu()
                fallback = self.forward_gpu_resident_to_token_id(last_token, cache, position)
                if fallback in config.stop_tokens:
                    break
                tokens.append(fallback)
                num_accepted = 1

            accepted_tokens += num_accepted

            # Step 4: Update position and last_token
            position += num_accepted
            last_token = tokens[-1]

            # Rollback cache to keep only accepted entries
            target_cache_len = cache_snapshot + num_accepted
            cache.rollback_to(target_cache_len, kv_dim)

        acceptance_rate = accepted_tokens / total_drafts * 100.0 if total_drafts else 0.0
        print(
            f"[PAR-100] Drafts: {total_drafts}, Accepted: {accepted_tokens}, "
            f"Rate: {acceptance_rate:.1f}%, Batched verifications: {total_speculative_batches}"
        )
        return tokens


def main():
    torch.manual_seed(0)
    config = QuantizedModelConfig()
    model = OwnedQuantizedModelCuda(OwnedQuantizedModel(config, seed=0))
    prompt = [3, 17, 42, 8, 25, 11, 60, 5]
    gen_config = QuantizedGenerateConfig(max_tokens=12, stop_tokens=())
    out = model.generate_speculative_cuda(prompt, gen_config, speculation_k=4)
    print("generated:", out[len(prompt):])


if __name__ == "__main__":
    main()
