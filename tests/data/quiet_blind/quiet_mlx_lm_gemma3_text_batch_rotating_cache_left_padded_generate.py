"""mlx-lm's Gemma 3 text model generating a left-padded batch, ported from MLX to torch.

Correct program (quiet batch quiet-r141b). Ported from ml-explore/mlx-lm
@d78bf58e217c904ec282ed8da9b947491f78c022:
  mlx_lm/models/gemma3_text.py  Attention (GQA, q_norm/k_norm, local/global RoPE bases,
                                rope(offset=cache.offset) before update_and_fetch),
                                Gemma3Model.__call__ (global_mask from
                                cache[sliding_window_pattern - 1], sliding_window_mask from
                                cache[0] with window_size), Model.make_cache (KVCache on
                                every pattern-th layer, RotatingKVCache(sliding_window) on
                                the others)
  mlx_lm/models/base.py         create_causal_mask, create_attention_mask, the dense
                                attention of quantized_scaled_dot_product_attention
                                (GQA by reshape, where(mask, scores, finfo.min))
  mlx_lm/models/cache.py        BatchKVCache, BatchRotatingKVCache (_update_concat,
                                _update_in_place, _temporal_order, make_mask); the
                                right-padding prepare()/finalize() path is left out
  mlx_lm/generate.py            _left_pad_prompts, _make_cache

Layers alternate sliding (window 5, rolling buffer of 5 slots) and global (growing
cache), sliding_window_pattern=2. Prompts are left padded; every cache starts with
offset = -left_padding, so RoPE puts each row's first real token at position 0. The
prompt minus its last token is prefilled in chunks of prefill_step_size, then the last
prompt token and every generated token go through one-token steps, where the rotating
cache writes into its ring and rolls its mask to match the slots.

Check: every logits row the batch produces equals that sequence's logits from a forward
over its whole unpadded text with no cache (the sliding layers masked by
create_causal_mask's window), and the greedy tokens agree.
"""

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    model_type: str = "gemma3_text"
    hidden_size: int = 64
    num_hidden_layers: int = 4
    intermediate_size: int = 128
    num_attention_heads: int = 4
    head_dim: int = 16
    rms_norm_eps: float = 1.0e-6
    vocab_size: int = 97
    num_key_value_heads: int = 2
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    query_pre_attn_scalar: float = 16
    sliding_window: int = 5
    sliding_window_pattern: int = 2


# ---------------------------------------------------------------- base.py


def create_causal_mask(
    N: int,
    offset: int = 0,
    window_size: Optional[int] = None,
    left_padding: Optional[torch.Tensor] = None,
):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    if left_padding is not None:
        mask = mask & (left_padding[:, None, None, None] <= rinds)
    return mask


def create_attention_mask(h, cache=None, window_size: Optional[int] = None, return_array: bool = False):
    N = h.shape[1]
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, window_size=window_size)
    return "causal"


def scaled_dot_product_attention(queries, keys, values, scale: float, mask):
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = keys.shape[-3]
    n_repeats = n_q_heads // n_kv_heads

    queries = queries * scale
    if n_repeats > 1:
        queries = queries.reshape(B, n_kv_heads, n_repeats, L, D)
        keys = keys.unsqueeze(-3)
        values = values.unsqueeze(-3)

    scores = queries @ keys.transpose(-1, -2)
    if mask is not None:
        if isinstance(mask, str):
            qL, kL = scores.shape[-2:]
            q_indices = torch.arange(kL - qL, kL)
            k_indices = torch.arange(kL)
            mask = q_indices[:, None] >= k_indices[None]
        if n_repeats > 1 and mask.ndim > 3:
            mask = mask.unsqueeze(-3)
        scores = torch.where(mask, scores, torch.finfo(scores.dtype).min)
    scores = torch.softmax(scores, dim=-1)
    out = scores @ values
    if n_repeats > 1:
        out = out.reshape(B, n_q_heads, L, D)
    return out


# ---------------------------------------------------------------- cache.py


class KVCache:
    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0


class RotatingKVCache:
    def __init__(self, max_size, keep=0):
        self.keep = keep
        self.max_size = max_size


class BatchKVCache:
    step = 256

    def __init__(self, left_padding: List[int]):
        self.keys = None
        self.values = None
        self.left_padding = torch.tensor(left_padding)
        self.offset = torch.tensor([-l for l in left_padding])
        self._idx = 0

    def update_and_fetch(self, keys, values):
        prev = self._idx
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            v_head_dim = values.shape[3]
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            new_k = keys.new_zeros((B, n_kv_heads, n_steps * self.step, k_head_dim))
            new_v = values.new_zeros((B, n_kv_heads, n_steps * self.step, v_head_dim))
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v

        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        self.keys[..., prev : self._idx, :] = keys
        self.values[..., prev : self._idx, :] = values
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)


class BatchRotatingKVCache:
    step = 256

    def __init__(self, max_size, left_padding: List[int]):
        self.keys = None
        self.values = None
        self.left_padding = torch.tensor(left_padding)
        self.offset = torch.tensor([-l for l in left_padding])
        self.max_size = max_size
        self._idx = 0
        self._offset = 0
        self.rotated = False

    def _trim(self, trim_size, v, append=None):
        if trim_size > 0:
            v = v[..., trim_size:, :]
        if append is not None:
            return torch.cat([v, append], dim=2)
        return v

    def _temporal_order(self):
        if self.rotated:
            self.keys = torch.roll(self.keys, -self._idx, dims=2)
            self.values = torch.roll(self.values, -self._idx, dims=2)
            self._idx = self.keys.shape[2]
            self.rotated = False

    def _update_concat(self, keys, values):
        if self.keys is None:
            self.keys = keys
            self.values = values
        else:
            self._temporal_order()
            if self.keys.shape[2] > self._idx:
                self.keys = self.keys[..., : self._idx, :]
                self.values = self.values[..., : self._idx, :]
            # The largest size is self.max_size + S - 1 to ensure
            # every token gets at least self.max_size context
            trim_size = self._idx - self.max_size + 1
            if trim_size > 0:
                self.left_padding = self.left_padding - trim_size
            self.keys = self._trim(trim_size, self.keys, keys)
            self.values = self._trim(trim_size, self.values, values)
        self.offset = self.offset + keys.shape[2]
        self._offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _update_in_place(self, keys, values):
        B, n_kv_heads, S, k_head_dim = keys.shape
        prev = self._offset
        if self.keys is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            v_head_dim = values.shape[3]
            new_size = min(self.step, self.max_size - prev)
            new_k = keys.new_zeros((B, n_kv_heads, new_size, k_head_dim))
            new_v = values.new_zeros((B, n_kv_heads, new_size, v_head_dim))
            if self.keys is not None:
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v
            self._idx = prev

        trim_size = self.keys.shape[2] - self.max_size
        if trim_size > 0:
            self.keys = self._trim(trim_size, self.keys)
            self.values = self._trim(trim_size, self.values)
            self._idx = self.max_size
            self.left_padding = self.left_padding - trim_size

        if self._idx == self.max_size:
            self.rotated = True
            self._idx = 0
        if self.rotated:
            self.left_padding = self.left_padding - S

        self.keys[..., self._idx : self._idx + S, :] = keys
        self.values[..., self._idx : self._idx + S, :] = values
        self._offset += S
        self.offset = self.offset + S
        self._idx += S

        if self._offset < self.max_size:
            return self.keys[..., : self._offset, :], self.values[..., : self._offset, :]
        return self.keys, self.values

    def update_and_fetch(self, keys, values):
        if keys.shape[2] == 1:
            return self._update_in_place(keys, values)
        return self._update_concat(keys, values)

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        left_padding = self.left_padding
        window_size = window_size or self.max_size
        offset = min(self.max_size - 1, self._offset)
        rinds = torch.arange(offset + N)
        linds = torch.arange(offset, offset + N) if offset else rinds
        linds = linds[:, None]
        rinds = rinds[None]
        mask = linds >= rinds
        mask &= linds < rinds + window_size
        if (trim_size := self._idx - self.max_size + int(N > 1)) > 0:
            left_padding = left_padding - trim_size

        rotated = N == 1 and (self.rotated or self._idx >= self.max_size)
        if rotated:
            left_padding = left_padding - 1

        mask = mask & (rinds >= left_padding[:, None, None, None])

        if rotated:
            idx = self._idx
            if idx >= self.max_size:
                idx = 0
            mask = torch.roll(mask, shifts=idx + 1, dims=-1)
        return mask


# ---------------------------------------------------------------- gemma3_text.py


class RoPE(nn.Module):
    """mlx.nn.RoPE(dims, traditional=False, base): rotate-half, offset scalar or per row."""

    def __init__(self, dims: int, base: float):
        super().__init__()
        self.dims = dims
        self.base = base

    def forward(self, x, offset=0):
        B, H, L, D = x.shape
        pos = torch.as_tensor(offset).reshape(-1, 1) + torch.arange(L)  # (B or 1, L)
        inv_freq = self.base ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
        theta = (pos[..., None].float() * inv_freq)[:, None]  # (B or 1, 1, L, D/2)
        cos, sin = theta.cos().to(x.dtype), theta.sin().to(x.dtype)
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dims))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), 1.0 + self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.repeats = n_heads // n_kv_heads
        self.head_dim = head_dim = args.head_dim
        self.layer_idx = layer_idx
        self.scale = args.query_pre_attn_scalar**-0.5

        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)

        self.q_norm = RMSNorm(dims=head_dim, eps=args.rms_norm_eps)
        self.k_norm = RMSNorm(dims=head_dim, eps=args.rms_norm_eps)
        self.is_sliding = (layer_idx + 1) % args.sliding_window_pattern != 0
        self.rope = RoPE(head_dim, base=args.rope_local_base_freq if self.is_sliding else args.rope_theta)

    def forward(self, x, mask=None, cache: Optional[Any] = None):
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)

        queries = self.q_norm(queries)
        keys = self.k_norm(keys)

        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)

        output = scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class MLP(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = x + self.post_attention_layernorm(r)
        r = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(r)


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.window_size = args.sliding_window
        self.sliding_window_pattern = args.sliding_window_pattern
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            [TransformerBlock(args=args, layer_idx=layer_idx) for layer_idx in range(args.num_hidden_layers)]
        )
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        h = h * torch.tensor(self.args.hidden_size**0.5, dtype=torch.bfloat16).to(h.dtype)

        if cache is None:
            cache = [None] * len(self.layers)

        global_mask = create_attention_mask(h, cache[self.sliding_window_pattern - 1])
        if self.sliding_window_pattern > 1:
            sliding_window_mask = create_attention_mask(h, cache[0], window_size=self.window_size)
        else:
            sliding_window_mask = None

        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            is_global = i % self.sliding_window_pattern == self.sliding_window_pattern - 1
            mask = global_mask if is_global else sliding_window_mask
            h = layer(h, mask, c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Gemma3Model(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, inputs, cache=None):
        return self.lm_head(self.model(inputs, cache))

    def make_cache(self):
        caches = []
        for i in range(self.args.num_hidden_layers):
            if i % self.args.sliding_window_pattern == self.args.sliding_window_pattern - 1:
                caches.append(KVCache())
            else:
                caches.append(RotatingKVCache(max_size=self.args.sliding_window))
        return caches


# ---------------------------------------------------------------- generate.py


def _left_pad_prompts(prompts, max_length=None):
    if max_length is None:
        max_length = max(len(p) for p in prompts)
    return torch.tensor([[0] * (max_length - len(p)) + p for p in prompts])


def _make_cache(model, left_padding):
    def to_batch_cache(c):
        if type(c) is KVCache:
            return BatchKVCache(left_padding)
        elif isinstance(c, RotatingKVCache):
            if c.keep > 0:
                raise ValueError("RotatingKVCache with keep tokens is not supported.")
            return BatchRotatingKVCache(c.max_size, left_padding)
        raise ValueError(f"{type(c)} does not yet support batching")

    return [to_batch_cache(c) for c in model.make_cache()]


@torch.no_grad()
def batch_generate(model, prompts: List[List[int]], max_tokens: int, prefill_step_size: int = 4):
    """Greedy generation; returns the tokens and the logits row behind each one."""
    lengths = [len(p) - 1 for p in prompts]
    max_length = max(lengths)
    left_padding = [max_length - l for l in lengths]
    cache = _make_cache(model, left_padding)

    tokens = _left_pad_prompts([p[:-1] for p in prompts], max_length=max_length)
    while tokens.shape[1] > 0:
        n_to_process = min(prefill_step_size, tokens.shape[1])
        model(tokens[:, :n_to_process], cache=cache)
        tokens = tokens[:, n_to_process:]

    y = torch.tensor([p[-1] for p in prompts])
    out_tokens, out_logits = [], []
    for _ in range(max_tokens):
        logits = model(y[:, None], cache=cache)[:, -1, :]
        y = logits.argmax(-1)
        out_tokens.append(y)
        out_logits.append(logits)
    return torch.stack(out_tokens, 1), torch.stack(out_logits, 1)


def main() -> None:
    torch.manual_seed(0)
    args = ModelArgs()
    model = Model(args).eval()
    for name, p in model.named_parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.3)
        else:
            nn.init.normal_(p, std=0.1)

    batches = [
        # padded prompt (8) longer than the window: chunked prefill wraps the window
        [[5, 9, 13, 2, 44, 71, 8, 30, 6], [7, 2, 30, 4], [21, 8, 64, 3, 11, 50]],
        # padded prompt (2) shorter than the window: the ring fills during decode
        [[3, 14, 27], [60, 1]],
    ]
    max_tokens = 9
    worst = 0.0
    for prompts in batches:
        gen, logits = batch_generate(model, prompts, max_tokens)
        for b, prompt in enumerate(prompts):
            text = prompt + gen[b].tolist()
            with torch.no_grad():
                ref = model(torch.tensor([text]))[0]  # no cache, no padding
            ref = ref[len(prompt) - 1 : len(prompt) - 1 + max_tokens]
            err = (ref - logits[b]).abs().max().item()
            worst = max(worst, err)
            assert err < 1e-4, (prompt, err)
            assert torch.equal(ref.argmax(-1), gen[b]), prompt
            print(f"prompt {prompt}: generated {gen[b].tolist()}  max |logit err| {err:.2e}")
    print(f"batched rolling-cache generation matches per-sequence uncached runs (worst {worst:.2e})")


if __name__ == "__main__":
    main()
