# ml-explore/mlx-examples#1000 ("RotatingKVCache: Problem when reusing cache between multiple generations"),
# fixed by ml-explore/mlx-examples#1015 (commit fca087be, "More cache improvements") and completed by #1093
# (commit ed9e81dd, "Fix rotating kv cache size"). llms/mlx_lm/models/base.py (RotatingKVCache,
# create_attention_mask) before fca087be; llms/mlx_lm/models/cache.py and base.py at ed9e81dd after.
# A chat keeps one prompt cache across turns (mlx_lm/chat.py: make_prompt_cache(model, max_kv_size) with keep=4,
# then stream_generate(..., prompt_cache=prompt_cache) per user message). During generation the RotatingKVCache
# writes one token at a time into a ring (slot self._idx, wrapping back to `keep`), so once the first answer has
# run past max_size the buffer is no longer in time order. Before the fix the next turn's prompt (S > 1 tokens)
# went through the prefill branch, which trimmed `keys.shape[2] - max_size + 1` slots from the front of that
# rotated buffer (right after the `keep` sink tokens) and appended the new keys: the trim threw away the token in
# slot `keep` (a recent one, written when the ring wrapped) instead of the oldest, and the prefill mask (offset
# min(max_size - 1, offset), no window) was laid over that order. Fix: put the ring back in temporal order
# (_temporal_order) before trimming by `self._idx - self.max_size`, and build the prefill mask with
# window_size=max_size and offset min(max_size, offset). (Before the fix generate_step made its own caches; the
# run before the fix keeps one cache list across turns the way the report's chat app does.)
# (mlx_lm/models/llama.py Model with tiny random weights, ported from MLX to torch; mx.fast.rope and
# mx.fast.scaled_dot_product_attention written with torch; token ids stand in for a chat template.)
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- mlx.core.fast stand-ins ------------------------------------------------------------------------------
def fast_rope(x, dims, traditional=False, base=10000.0, scale=1.0, offset=0):
    # x: (B, H, L, D), rotates the first `dims` features, positions offset .. offset + L - 1
    L = x.shape[-2]
    half = dims // 2
    inv = base ** (-torch.arange(0, half, dtype=torch.float32) / half)
    pos = scale * (offset + torch.arange(L, dtype=torch.float32))
    ang = pos[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:dims]
    rot = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return torch.cat([rot, x[..., dims:]], dim=-1).to(x.dtype)


def fast_scaled_dot_product_attention(queries, keys, values, scale, mask=None):
    return F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=keys.shape[1] != queries.shape[1]
    )


# ---- models/base.py (and models/cache.py after the fix) ----------------------------------------------------
@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params):
        import inspect

        return cls(**{k: v for k, v in params.items() if k in inspect.signature(cls).parameters})


class KVCache:
    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0
        self.step = 256

    def update_and_fetch(self, keys, values):
        prev = self.offset
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            v_head_dim = values.shape[3]
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            new_k = torch.zeros((B, n_kv_heads, n_steps * self.step, k_head_dim), dtype=keys.dtype)
            new_v = torch.zeros((B, n_kv_heads, n_steps * self.step, v_head_dim), dtype=values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset += keys.shape[2]
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def state(self):
        return self.keys, self.values


if not FIXED:

    class RotatingKVCache:

        def __init__(self, head_dim, n_kv_heads, max_size, keep=0, step=256):
            self.n_kv_heads = n_kv_heads
            if isinstance(head_dim, int):
                self.k_head_dim = self.v_head_dim = head_dim
            elif isinstance(head_dim, tuple) and len(head_dim) == 2:
                self.k_head_dim, self.v_head_dim = head_dim
            else:
                raise ValueError("head_dim must be an int or a tuple of two ints")
            self.keep = keep
            self.keys = None
            self.values = None
            self.offset = 0
            self.max_size = max_size
            self.step = step
            self._idx = 0

        def _trim(self, trim_size, v, append=None):
            to_cat = []
            if trim_size > 0:
                to_cat = [v[..., : self.keep, :], v[..., trim_size + self.keep :, :]]
            else:
                to_cat = [v]
            if append is not None:
                to_cat.append(append)
            return torch.cat(to_cat, dim=2)

        def update_and_fetch(self, keys, values):
            prev = self.offset
            B, _, S = keys.shape[:3]

            # Prefill mode
            if S > 1:
                if self.keys is None:
                    self.keys = keys
                    self.values = values
                else:
                    # The largest size is self.max_size + S - 1 to ensure
                    # every token gets at least self.max_size context
                    trim_size = self.keys.shape[2] - self.max_size + 1
                    self.keys = self._trim(trim_size, self.keys, keys)
                    self.values = self._trim(trim_size, self.values, values)
                self.offset += S
                self._idx = self.keys.shape[2]
                return self.keys, self.values

            # Generation mode
            # May not have hit the max size yet, so potentially
            # keep growing the cache
            if self.keys is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
                new_size = min(self.step, self.max_size - prev)
                k_shape = (B, self.n_kv_heads, new_size, self.k_head_dim)
                v_shape = (B, self.n_kv_heads, new_size, self.v_head_dim)
                new_k = torch.zeros(k_shape, dtype=keys.dtype)
                new_v = torch.zeros(v_shape, dtype=values.dtype)
                if self.keys is not None:
                    self.keys = torch.cat([self.keys, new_k], dim=2)
                    self.values = torch.cat([self.values, new_v], dim=2)
                else:
                    self.keys, self.values = new_k, new_v
                self._idx = prev

            # Trim if needed
            trim_size = self.keys.shape[2] - self.max_size
            if trim_size > 0:
                self.keys = self._trim(trim_size, self.keys)
                self.values = self._trim(trim_size, self.values)
                self._idx = self.max_size

            # Rotate
            if self._idx == self.max_size:
                self._idx = self.keep

            # Assign
            self.keys[..., self._idx : self._idx + 1, :] = keys
            self.values[..., self._idx : self._idx + 1, :] = values
            self.offset += 1
            self._idx += 1

            # If the buffer is not full, slice off the end
            if self.offset < self.max_size:
                return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
            return self.keys, self.values

        @property
        def state(self):
            return self.keys, self.values

    def create_additive_causal_mask(N: int, offset: int = 0):
        rinds = torch.arange(offset + N)
        linds = torch.arange(offset, offset + N) if offset else rinds
        mask = linds[:, None] < rinds[None]
        return mask * -1e9

    def create_attention_mask(h: torch.Tensor, cache: Optional[Any] = None):
        T = h.shape[1]
        if T > 1:
            if cache is not None and cache[0] is not None:
                c = cache[0]
                if isinstance(c, RotatingKVCache):
                    offset = min(c.max_size - 1, c.offset)
                else:
                    offset = c.offset
            else:
                offset = 0
            mask = create_additive_causal_mask(T, offset)
            mask = mask.to(h.dtype)
        else:
            mask = None
        return mask

    def make_prompt_cache(model, max_kv_size=None):
        # utils.make_kv_caches
        if hasattr(model, "make_cache"):
            return model.make_cache()
        kv_heads = [model.n_kv_heads] * len(model.layers)
        if max_kv_size is not None:
            return [RotatingKVCache(model.head_dim, n, max_size=max_kv_size, keep=4) for n in kv_heads]
        else:
            return [KVCache() for n in kv_heads]

else:

    class RotatingKVCache:

        def __init__(self, max_size=None, keep=0, step=256):
            self.keep = keep
            self.keys = None
            self.values = None
            self.offset = 0
            self.max_size = max_size
            self.step = step
            self._idx = 0

        def _trim(self, trim_size, v, append=None):
            to_cat = []
            if trim_size > 0:
                to_cat = [v[..., : self.keep, :], v[..., trim_size + self.keep :, :]]
            else:
                to_cat = [v]
            if append is not None:
                to_cat.append(append)
            return torch.cat(to_cat, dim=2)

        def _temporal_order(self, v):
            """
            Rearrange the cache into temporal order, slicing off the end if unused.
            """
            if self._idx == v.shape[2]:
                return v
            elif self._idx < self.offset:
                return torch.cat(
                    [
                        v[..., : self.keep, :],
                        v[..., self._idx :, :],
                        v[..., self.keep : self._idx, :],
                    ],
                    dim=2,
                )
            else:
                return v[..., : self._idx, :]

        def _update_concat(self, keys, values):
            if self.keys is None:
                self.keys = keys
                self.values = values
            else:
                # Put the keys/values in temporal order to
                # preserve context
                self.keys = self._temporal_order(self.keys)
                self.values = self._temporal_order(self.values)

                # The largest size is self.max_size + S to ensure
                # every token gets at least self.max_size context
                trim_size = self._idx - self.max_size
                self.keys = self._trim(trim_size, self.keys, keys)
                self.values = self._trim(trim_size, self.values, values)
            self.offset += keys.shape[2]
            self._idx = self.keys.shape[2]
            return self.keys, self.values

        def _update_in_place(self, keys, values):
            # May not have hit the max size yet, so potentially
            # keep growing the cache
            B, n_kv_heads, S, k_head_dim = keys.shape
            prev = self.offset
            if self.keys is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
                v_head_dim = values.shape[3]
                new_size = min(self.step, self.max_size - prev)
                k_shape = (B, n_kv_heads, new_size, k_head_dim)
                v_shape = (B, n_kv_heads, new_size, v_head_dim)
                new_k = torch.zeros(k_shape, dtype=keys.dtype)
                new_v = torch.zeros(v_shape, dtype=values.dtype)
                if self.keys is not None:
                    self.keys = torch.cat([self.keys, new_k], dim=2)
                    self.values = torch.cat([self.values, new_v], dim=2)
                else:
                    self.keys, self.values = new_k, new_v
                self._idx = prev

            # Trim if needed
            trim_size = self.keys.shape[2] - self.max_size
            if trim_size > 0:
                self.keys = self._trim(trim_size, self.keys)
                self.values = self._trim(trim_size, self.values)
                self._idx = self.max_size

            # Rotate
            if self._idx == self.max_size:
                self._idx = self.keep

            # Assign
            self.keys[..., self._idx : self._idx + S, :] = keys
            self.values[..., self._idx : self._idx + S, :] = values
            self.offset += S
            self._idx += S

            # If the buffer is not full, slice off the end
            if self.offset < self.max_size:
                return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
            return self.keys, self.values

        def update_and_fetch(self, keys, values):
            if keys.shape[2] == 1:
                return self._update_in_place(keys, values)
            return self._update_concat(keys, values)

        @property
        def state(self):
            if self.offset < self.keys.shape[2]:
                return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
            else:
                return self.keys, self.values

    def create_causal_mask(N: int, offset: int = 0, window_size: Optional[int] = None):
        rinds = torch.arange(offset + N)
        linds = torch.arange(offset, offset + N) if offset else rinds
        linds = linds[:, None]
        rinds = rinds[None]
        mask = linds < rinds
        if window_size is not None:
            mask = mask | (linds > rinds + window_size)
        return mask * -1e9

    def create_attention_mask(h: torch.Tensor, cache: Optional[Any] = None):
        T = h.shape[1]
        if T > 1:
            window_size = None
            offset = 0
            if cache is not None and cache[0] is not None:
                c = cache[0]
                if hasattr(c, "max_size"):
                    offset = min(c.max_size, c.offset)
                    window_size = c.max_size
                else:
                    offset = c.offset
            mask = create_causal_mask(T, offset, window_size=window_size)
            mask = mask.to(h.dtype)
        else:
            mask = None
        return mask

    def make_prompt_cache(model, max_kv_size=None):
        # models/cache.make_prompt_cache
        if hasattr(model, "make_cache"):
            return model.make_cache()
        num_layers = len(model.layers)
        if max_kv_size is not None:
            return [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in range(num_layers)]
        else:
            return [KVCache() for _ in range(num_layers)]


# ---- models/llama.py ---------------------------------------------------------------------------------------
@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    head_dim: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float = 10000
    rope_traditional: bool = False
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads


class DynamicNTKScalingRoPE(nn.Module):
    def __init__(self, dims, max_position_embeddings=2048, traditional=False, base=10000, scale=1.0):
        super().__init__()
        self.dims = dims
        self.max_position_embeddings = max_position_embeddings
        self.traditional = traditional
        self.scale = scale
        self.base = base

    def forward(self, x, offset: int = 0):
        return fast_rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset)


def initialize_rope(args: ModelArgs):
    head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
    return DynamicNTKScalingRoPE(
        dims=head_dim,
        max_position_embeddings=args.max_position_embeddings,
        traditional=args.rope_traditional,
        base=args.rope_theta,
        scale=1.0,
    )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim = args.head_dim or args.hidden_size // n_heads
        self.scale = head_dim**-0.5
        attention_bias = args.attention_bias
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=attention_bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=attention_bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=attention_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=attention_bias)
        self.rope = initialize_rope(args)

    def forward(self, x, mask=None, cache=None):
        B, L, D = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(1, 2)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)
        output = fast_scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden_dim = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=args.mlp_bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=args.mlp_bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=args.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = x + r
        r = self.mlp(self.post_attention_layernorm(h))
        return h + r


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.num_hidden_layers)])
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, cache=None):
        h = self.embed_tokens(inputs)
        mask = create_attention_mask(h, cache)
        if cache is None:
            cache = [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)

    def forward(self, inputs, cache=None):
        out = self.model(inputs, cache)
        return out @ self.model.embed_tokens.weight.T  # embed_tokens.as_linear

    @property
    def layers(self):
        return self.model.layers

    @property
    def head_dim(self):
        return self.args.head_dim or self.args.hidden_size // self.args.num_attention_heads

    @property
    def n_kv_heads(self):
        return self.args.num_key_value_heads


# ---- utils.py: generate_step / generate, chat.py ----------------------------------------------------------
def generate_step(prompt, model, prompt_cache, prefill_step_size=512):
    def sample(logits):
        logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        return torch.argmax(logits, dim=-1), logprobs

    def _step(y):
        logits = model(y[None], cache=prompt_cache)
        logits = logits[:, -1, :]
        y, logprobs = sample(logits)
        return y.squeeze(0), logprobs.squeeze(0)

    y = prompt
    while y.numel() > prefill_step_size:
        model(y[:prefill_step_size][None], cache=prompt_cache)
        y = y[prefill_step_size:]

    y, logprobs = _step(y)
    while True:
        next_y, next_logprobs = _step(y.reshape(1))
        yield y.item(), logprobs
        y, logprobs = next_y, next_logprobs


@torch.no_grad()
def generate(model, prompt_tokens, max_tokens, prompt_cache):
    tokens, logps = [], []
    for n, (token, logprobs) in zip(range(max_tokens), generate_step(prompt_tokens, model, prompt_cache)):
        tokens.append(token)
        logps.append(logprobs[token].item())
    return tokens, logps


def main():
    args = ModelArgs.from_dict(
        dict(
            model_type="llama",
            hidden_size=32,
            num_hidden_layers=2,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            vocab_size=64,
            rope_theta=10000.0,
        )
    )
    model = Model(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.4)

    max_kv_size = 12
    prompt_cache = make_prompt_cache(model, max_kv_size)
    turns = [
        (torch.tensor([1, 17, 23, 5, 42, 9]), 10),  # user turn 1, then the assistant's answer
        (torch.tensor([1, 31, 8, 56, 12]), 8),  # user turn 2, same cache
    ]
    for i, (prompt_tokens, max_tokens) in enumerate(turns):
        tokens, logps = generate(model, prompt_tokens, max_tokens, prompt_cache)
        print(f"turn {i + 1}: tokens {tokens}")
        print(f"turn {i + 1}: sum of chosen logprobs {sum(logps):.4f}, cache offset {prompt_cache[0].offset}")


if __name__ == "__main__":
    main()
