"""mlx-vlm Phi-3-Vision: the processor's attention_mask was used as the prefill mask, in place of the causal one.

Citation: Blaizzy/mlx-vlm#440 (commit 8c8d1c04, "Fix phi3_v and molmo mask"),
mlx_vlm/models/phi3_v/phi3_v.py (and molmo/language.py).

The bug: ``generate`` takes ``mask = inputs["attention_mask"]`` from ``prepare_inputs`` (a
(1, L) row of ones) and ``generate_step`` passes it as ``mask=`` to the model's prefill call.
``Phi3V.__call__`` only built the causal mask when ``mask is None``; given the processor's
row it handed that row straight to ``mx.fast.scaled_dot_product_attention``, which broadcasts
it over every query row, so the whole image + prompt prefill ran without a causal mask.

The fix: when a mask is passed, combine it with a lower-triangular mask:
``mask = (mask & tril(ones(L, L))) > 0``.

This is a torch port of the MLX code at toy sizes with random weights: the Phi-3 text decoder
(fused qkv_proj, RoPE, KVCache with ``offset`` / ``update_and_fetch``), Phi-3-V's negative
image-token ids whose rows are overwritten by the image embedding, ``generate_step`` with a
prefill and greedy decode steps. ``mx.fast.scaled_dot_product_attention`` is rendered by a
helper with MLX's mask semantics (a bool mask keeps True, any other dtype is added to the
scores) calling torch's SDPA. The CLIP image tower is reduced to a linear patch projection.
"""

import math
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class TextConfig:
    model_type: str = "phi3_v"
    hidden_size: int = 64
    num_hidden_layers: int = 3
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-5
    vocab_size: int = 100
    rope_theta: float = 10000.0
    image_dim_out: int = 24
    num_img_tokens: int = 6


def scaled_dot_product_attention(queries, keys, values, scale, mask=None):
    """mx.fast.scaled_dot_product_attention: bool masks select, other masks are added."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(queries.dtype)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)


class RoPE(nn.Module):
    def __init__(self, dims, base=10000.0):
        super().__init__()
        self.dims = dims
        self.base = base

    def forward(self, x, offset=0):
        L = x.shape[-2]
        inv = 1.0 / (self.base ** (torch.arange(0, self.dims, 2, dtype=torch.float32) / self.dims))
        t = torch.arange(offset, offset + L, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        cos, sin = freqs.cos(), freqs.sin()
        x1, x2 = x[..., : self.dims // 2], x[..., self.dims // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class KVCache:
    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        self.offset += keys.shape[2]
        return self.keys, self.values


def create_attention_mask(h, cache=None):
    T = h.shape[1]
    if T > 1:
        offset = 0
        if cache is not None and cache[0] is not None:
            offset = cache[0].offset
        rinds = torch.arange(offset + T)
        linds = torch.arange(offset, offset + T)
        return linds[:, None] >= rinds[None]
    return None


class Attention(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        dim = config.hidden_size
        self.n_heads = n_heads = config.num_attention_heads
        self.n_kv_heads = n_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim = config.hidden_size // n_heads
        self.scale = head_dim**-0.5
        op_size = n_heads * head_dim + 2 * (n_kv_heads * head_dim)
        self.qkv_proj = nn.Linear(dim, op_size, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.rope = RoPE(head_dim, base=config.rope_theta)

    def forward(self, x, mask=None, cache: Optional[KVCache] = None):
        B, L, D = x.shape
        qkv = self.qkv_proj(x)
        query_pos = self.n_heads * self.head_dim
        queries, keys, values = torch.split(
            qkv, [query_pos, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim], dim=-1
        )
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

        output = scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class MLP(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x):
        gate, x = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * x)


class TransformerBlock(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = x + r
        r = self.mlp(self.post_attention_layernorm(h))
        return h + r


class VisionModel(nn.Module):
    """Phi-3-V image embedding, tower reduced to a projection; rows written at the -1 ids."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.num_img_tokens = config.num_img_tokens
        self.img_projection = nn.Sequential(
            nn.Linear(config.image_dim_out, config.hidden_size),
            nn.GELU(),
            nn.Linear(config.hidden_size, config.hidden_size),
        )

    def forward(self, img_embeds, txt_embeds=None, img_sizes=None, positions=None):
        B = img_embeds.shape[0]
        output_imgs, output_len = [], []
        for _bs in range(B):
            x = self.img_projection(img_embeds[_bs])
            output_imgs.append(x)
            output_len.append(self.num_img_tokens)
        txt_embeds = txt_embeds.clone()
        idx = 0
        for i, cnt in enumerate(output_len):
            txt_embeds[positions[idx][0], positions[idx][1] : positions[idx][1] + cnt] = output_imgs[i]
            idx += cnt
        return txt_embeds


class Phi3V(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.vision_embed_tokens = VisionModel(config)
        self.layers = nn.ModuleList([TransformerBlock(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs, pixel_values=None, image_sizes=None, mask=None, cache=None):
        h = self.embed_tokens(inputs.clamp(min=0))
        p = np.argwhere(inputs.numpy() < 0).tolist()

        if pixel_values is not None:
            h = self.vision_embed_tokens(pixel_values, h, image_sizes, p)

        if cache is None:
            cache = [None] * len(self.layers)

        if mask is None:
            mask = create_attention_mask(h, cache)
        elif FIXED:
            seq_len = h.shape[-2]
            causal_mask = torch.tril(torch.ones((seq_len, seq_len), dtype=torch.bool))
            mask = (mask & causal_mask) > 0

        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)

        return self.norm(h)


class Model(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.model_type = config.model_type
        self.model = Phi3V(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.config = config

    def forward(self, inputs, pixel_values=None, mask=None, cache=None, image_sizes=None, **kwargs):
        out = self.model(inputs, pixel_values, image_sizes, mask=mask, cache=cache)
        return self.lm_head(out)

    @property
    def layers(self):
        return self.model.layers

    @property
    def language_model(self):
        return self


def make_prompt_cache(model):
    return [KVCache() for _ in model.layers]


def prepare_inputs(config):
    # "<|user|>\n<|image_1|>\nWhat is shown?<|end|>\n<|assistant|>\n": the processor
    # expands <|image_1|> to -1 ids, one per image token, and returns a ones mask.
    prompt = [1, 32, 13] + [-1] * config.num_img_tokens + [13, 41, 52, 17, 60, 5, 13, 33, 13]
    input_ids = torch.tensor([prompt])
    pixel_values = torch.randn(1, config.num_img_tokens, config.image_dim_out)
    return {
        "input_ids": input_ids,
        "pixel_values": pixel_values,
        "attention_mask": torch.ones_like(input_ids),
        "image_sizes": torch.tensor([[336, 336]]),
    }


@torch.no_grad()
def generate_step(input_ids, model, pixel_values, mask, max_tokens=6, **kwargs):
    prompt_cache = make_prompt_cache(model.language_model)

    def sample(logits):
        logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        return torch.argmax(logits, dim=-1), logprobs

    def _step(y):
        logits = model.language_model(y[None], cache=prompt_cache)
        return sample(logits[:, -1, :])

    logits = model(input_ids, pixel_values, cache=prompt_cache, mask=mask, **kwargs)
    y, logprobs = sample(logits[:, -1, :])
    n = 0
    while n < max_tokens:
        yield y, logprobs
        y, logprobs = _step(y)
        n += 1


def generate(model, config):
    inputs = prepare_inputs(config)
    input_ids = inputs["input_ids"]
    pixel_values = inputs["pixel_values"]
    mask = inputs["attention_mask"]
    kwargs = {"image_sizes": inputs["image_sizes"]}
    tokens, first_logprobs = [], None
    for n, (token, logprobs) in enumerate(generate_step(input_ids, model, pixel_values, mask, **kwargs)):
        if n == 0:
            first_logprobs = logprobs
        tokens.append(int(token.item()))
    return tokens, first_logprobs


def main():
    torch.manual_seed(0)
    config = TextConfig()
    model = Model(config).eval()
    tokens, first_logprobs = generate(model, config)
    print("fixed" if FIXED else "buggy", "generated:", tokens)
    print("first-step top logprob: %.6f" % first_logprobs.max().item())


if __name__ == "__main__":
    main()
