"""mlx-vlm batched generation: the processor's left padding never reaches the KV caches, pads are attended.

Citation: Blaizzy/mlx-vlm#1946 ("Stop a batched row's answer depending on its neighbour's length", merged).

Bug (from the PR description): "The tokenizer squares a batch off with left padding and reports it in the
attention mask, which is used to build embeddings and then dropped. The generator therefore receives rows of
uniform length, computes no padding of its own, and records none on the caches, so every layer reads the pad
tokens: a causal mask does not exclude padding that comes first".

Fix: "Pass the padding on" -- the left padding counted from the attention mask is handed to the batch
caches (``BatchKVCache(left_padding)``), whose ``make_mask`` already turns it into a per-row validity mask.

This program is a torch port written the way mlx-vlm / mlx-lm hold it: a processor output dict with
``input_ids`` and ``attention_mask`` (left padded), ``BatchKVCache`` with ``left_padding`` / ``offset`` /
``_idx`` and ``make_mask``, ``create_attention_mask(h, cache)`` and ``create_causal_mask(N, offset,
left_padding=...)``; attention is ``F.scaled_dot_product_attention``.  Two prompts of lengths 7 and 3
(four pads), prefill then two decode steps: buggy, row 1 attends its four pads at every step; fixed, not.
Only the PR description was read, not its diff; the cache and mask helpers follow mlx-lm's cache.py/base.py.
"""
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

PAD_ID = 0


def create_causal_mask(N: int, offset: int = 0, window_size: Optional[int] = None, left_padding=None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N)
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    if left_padding is not None:
        mask = mask & (rinds >= left_padding.view(-1, 1, 1, 1))
    return mask


def create_attention_mask(h, cache=None, window_size=None, return_array=False):
    N = h.shape[1]
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    return "causal"


class BatchKVCache:
    def __init__(self, left_padding):
        self.keys = None
        self.values = None
        self.left_padding = torch.tensor(left_padding)
        self.offset = -self.left_padding
        self._idx = 0

    def __bool__(self):
        return True

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if not self.left_padding.any() and N == 1:
            return None
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, window_size=window_size)


def scaled_dot_product_attention(queries, keys, values, scale, mask):
    if isinstance(mask, str):
        return F.scaled_dot_product_attention(queries, keys, values, scale=scale, is_causal=True)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)


class Attention(nn.Module):
    def __init__(self, dim=32, n_heads=4):
        super().__init__()
        self.n_heads = n_heads
        self.scale = (dim // n_heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask=None, cache=None):
        B, L, D = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, D))


class DecoderLayer(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.self_attn = Attention(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
        self.input_layernorm = nn.LayerNorm(dim)
        self.post_attention_layernorm = nn.LayerNorm(dim)

    def forward(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LanguageModel(nn.Module):
    def __init__(self, vocab=64, dim=32, n_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([DecoderLayer(dim) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, inputs=None, inputs_embeds=None, cache=None):
        h = inputs_embeds if inputs_embeds is not None else self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.lm_head(self.norm(h))


class Model(nn.Module):
    """A toy VLM: image features are merged into the token embeddings before the language model."""

    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.language_model = LanguageModel(vocab, dim)
        self.image_token_index = 5
        self.vision_proj = nn.Linear(16, dim)

    def get_input_embeddings(self, input_ids, pixel_values, mask):
        embeds = self.language_model.embed_tokens(input_ids)
        image_features = self.vision_proj(pixel_values)
        is_image = (input_ids == self.image_token_index) & mask.bool()
        embeds = embeds.clone()
        embeds[is_image] = image_features[: int(is_image.sum())]
        return embeds


def make_prompt_cache(model, left_padding):
    return [BatchKVCache(left_padding) for _ in model.language_model.layers]


def batch_generate(model, inputs, max_tokens=2):
    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    embeds = model.get_input_embeddings(input_ids, inputs["pixel_values"], attention_mask)
    if FIXED:
        left_padding = (attention_mask == 0).sum(dim=1).tolist()
    else:
        # the attention mask was used for the embeddings and then dropped: rows look uniform
        left_padding = [0] * input_ids.shape[0]
    cache = make_prompt_cache(model, left_padding)
    logits = model.language_model(inputs_embeds=embeds, cache=cache)
    y = logits[:, -1].argmax(-1)
    out = [y]
    for _ in range(max_tokens - 1):
        logits = model.language_model(inputs=y[:, None], cache=cache)
        y = logits[:, -1].argmax(-1)
        out.append(y)
    return torch.stack(out, dim=1)


def main():
    torch.manual_seed(0)
    model = Model().eval()
    prompts = [[1, 5, 5, 9, 12, 7, 3], [1, 5, 8]]
    L = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD_ID] * (L - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": torch.randn(3, 16)}
    with torch.no_grad():
        tokens = batch_generate(model, inputs)
    print(f"{'fixed' if FIXED else 'buggy'} tokens {tokens.tolist()}")


if __name__ == "__main__":
    main()
