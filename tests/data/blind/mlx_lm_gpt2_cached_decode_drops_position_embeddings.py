# mlx-lm (ml-explore/mlx-lm#93, commit db368f2, "Fix GPT2 Incremental Generation by Correctly Applying Position
# Embeddings and Offsets"): mlx_lm/models/gpt2.py GPT2Model added the learned position embeddings (and built the
# causal mask) only `if hidden_states.shape[1] > 1`, with positions np.arange(L) from 0. A cached decode step (one
# token) therefore got no position embedding at all, and a multi-token chunk after a cache would restart at 0. The
# fix reads the offset from cache[0].offset, always adds wpe(arange(offset, offset + L)) and always builds the mask.
# Ported from MLX to torch (mx ops written as their torch equivalents; mx.fast.scaled_dot_product_attention's
# "causal" string mask as a bottom-right causal boolean mask).
import sys
import inspect
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- mlx_lm/models/base.py
@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params):
        return cls(**{k: v for k, v in params.items() if k in inspect.signature(cls).parameters})


def create_causal_mask(N: int, offset: int = 0, window_size: Optional[int] = None, lengths=None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds <= rinds + window_size)
    if lengths is not None:
        lengths = lengths[:, None, None, None]
        mask = mask & (rinds < lengths)
    return mask


def create_attention_mask(h, cache: Optional[Any] = None, return_array: bool = False):
    T = h.shape[1]
    if T > 1:
        offset = 0
        window_size = None
        if cache is not None and cache[0] is not None:
            c = cache[0]
            offset = c.offset
            if hasattr(c, "max_size"):
                window_size = c.max_size
                offset = min(window_size, offset)
                return_array = return_array or offset + T > window_size
        if return_array:
            return create_causal_mask(T, offset, window_size=window_size)
        else:
            return "causal"
    else:
        mask = None
    return mask


def fast_scaled_dot_product_attention(queries, keys, values, scale, mask=None):
    # mx.fast.scaled_dot_product_attention: mask is None, "causal" (aligned to the last key) or an array
    if isinstance(mask, str) and mask == "causal":
        L, S = queries.shape[2], keys.shape[2]
        mask = torch.arange(S)[None] <= torch.arange(S - L, S)[:, None]
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask):
    return fast_scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


# ---- mlx_lm/models/cache.py
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
            k_shape = (B, n_kv_heads, n_steps * self.step, k_head_dim)
            v_shape = (B, n_kv_heads, n_steps * self.step, v_head_dim)
            new_k = torch.zeros(k_shape, dtype=keys.dtype)
            new_v = torch.zeros(v_shape, dtype=values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v

        self.offset += keys.shape[2]
        self.keys[..., prev: self.offset, :] = keys
        self.values[..., prev: self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]


def make_prompt_cache(model):
    return [KVCache() for _ in range(len(model.layers))]


# ---- mlx_lm/models/gpt2.py
@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    n_ctx: int
    n_embd: int
    n_head: int
    n_layer: int
    n_positions: int
    layer_norm_epsilon: float
    vocab_size: int
    num_key_value_heads: int = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.n_head


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        assert args.n_embd % args.n_head == 0, "n_embd must be divisible by n_head"
        self.n_embd = args.n_embd
        self.n_head = args.n_head
        self.head_dim = self.n_embd // self.n_head
        self.scale = self.head_dim ** -0.5
        self.c_attn = nn.Linear(self.n_embd, 3 * self.n_embd, bias=True)
        self.c_proj = nn.Linear(self.n_embd, self.n_embd, bias=True)

    def forward(self, x, mask=None, cache: Optional[Any] = None):
        B, L, D = x.shape
        qkv = self.c_attn(x)
        queries, keys, values = torch.split(qkv, self.n_embd, dim=-1)

        # Prepare the queries, keys and values for the attention computation
        queries = queries.reshape(B, L, self.n_head, -1).transpose(1, 2)
        keys = keys.reshape(B, L, self.n_head, -1).transpose(1, 2)
        values = values.reshape(B, L, self.n_head, -1).transpose(1, 2)

        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)

        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.c_proj(output)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_embd = args.n_embd
        self.c_fc = nn.Linear(self.n_embd, 4 * self.n_embd)
        self.c_proj = nn.Linear(4 * self.n_embd, self.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_head = args.n_head
        self.n_embd = args.n_embd
        self.layer_norm_epsilon = args.layer_norm_epsilon
        self.attn = Attention(args)
        self.mlp = MLP(args)
        self.ln_1 = nn.LayerNorm(self.n_embd, eps=self.layer_norm_epsilon)
        self.ln_2 = nn.LayerNorm(self.n_embd, eps=self.layer_norm_epsilon)

    def forward(self, x, mask=None, cache: Optional[Any] = None):
        r = self.attn(self.ln_1(x), mask, cache)
        h = x + r
        r = self.mlp(self.ln_2(h))
        out = h + r
        return out


class GPT2Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_embd = args.n_embd
        self.n_positions = args.n_positions
        self.vocab_size = args.vocab_size
        self.n_layer = args.n_layer
        self.layer_norm_epsilon = args.layer_norm_epsilon
        assert self.vocab_size > 0
        self.wte = nn.Embedding(self.vocab_size, self.n_embd)
        self.wpe = nn.Embedding(self.n_positions, self.n_embd)
        self.h = nn.ModuleList([TransformerBlock(args=args) for _ in range(self.n_layer)])
        self.ln_f = nn.LayerNorm(self.n_embd, eps=self.layer_norm_epsilon)

    def forward(self, inputs, mask=None, cache=None):
        _, L = inputs.shape

        hidden_states = self.wte(inputs)

        if not FIXED:
            mask = None
            if hidden_states.shape[1] > 1:

                position_ids = torch.from_numpy(np.arange(L))
                hidden_states += self.wpe(position_ids)

                if mask is None:
                    mask = create_attention_mask(hidden_states, cache)
        else:
            offset = 0
            if cache is not None and len(cache) > 0 and cache[0] is not None:
                offset = cache[0].offset

            position_ids = torch.arange(offset, offset + L)
            hidden_states += self.wpe(position_ids)

            if mask is None:
                mask = create_attention_mask(hidden_states, cache)

        if cache is None:
            cache = [None] * len(self.h)

        for layer, c in zip(self.h, cache):
            hidden_states = layer(hidden_states, mask, cache=c)

        return self.ln_f(hidden_states)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = GPT2Model(args)

    def forward(self, inputs, mask=None, cache=None):
        out = self.model(inputs, mask, cache)
        out = out @ self.model.wte.weight.T  # self.model.wte.as_linear(out)
        return out

    @property
    def layers(self):
        return self.model.h


# ---- mlx_lm/generate.py generate_step (greedy sampler): prefill the prompt into the cache, then one token a step
@torch.no_grad()
def generate_step(prompt, model, max_tokens=8):
    prompt_cache = make_prompt_cache(model)

    def _step(y):
        logits = model(y[None], cache=prompt_cache)
        logits = logits[:, -1, :]
        logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        y = torch.argmax(logprobs, dim=-1)
        return y, logprobs.squeeze(0)

    y, logprobs = _step(prompt)
    n = 0
    while n < max_tokens:
        yield y.item(), logprobs
        y, logprobs = _step(y)
        n += 1


args = ModelArgs.from_dict(dict(model_type="gpt2", n_ctx=64, n_embd=64, n_head=4, n_layer=2, n_positions=64,
                                layer_norm_epsilon=1e-5, vocab_size=100))
model = Model(args).eval()
for p in model.parameters():
    nn.init.normal_(p, std=0.3)

prompt = torch.tensor([5, 17, 42, 8, 63, 21, 9, 77, 30, 11])
tokens, last_logprobs = [], None
for token, logprobs in generate_step(prompt, model, max_tokens=8):
    tokens.append(token)
    last_logprobs = logprobs

print("generated:", tokens)
print("last-step logprobs[:5]:", [round(v, 4) for v in last_logprobs[:5].tolist()])
