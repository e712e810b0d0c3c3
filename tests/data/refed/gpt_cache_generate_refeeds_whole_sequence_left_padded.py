# The same bug as infini-transformer-pytorch c42031f, written as a nanoGPT-style model keeps it: a dataclass config,
# a left-padded batch of 3 prompts, SDPA, and a KV cache object that keeps each key's padding beside the keys (laid on
# the scores as an additive finfo.min bias). The sampling loop hands the model the whole sequence so far (`generated`)
# at every step while the cache keeps every key it was given: each step's keys hold the prompt and the earlier samples
# again, and the queries see both copies. The fix feeds only the last sampled token once the cache holds the rest.
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class GPTConfig:
    vocab_size: int = 50
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    pad_token_id: int = 0


class KVCache:
    """Per layer: keys, values (B, H, T, D) and each key's padding (B, T), True = a real token."""

    def __init__(self, n_layer):
        self.k = [None] * n_layer
        self.v = [None] * n_layer
        self.real = None

    def append(self, layer, k, v):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x, cache: KVCache, key_real):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        k, v = cache.append(self.layer, k, v)
        S = k.shape[2]
        # a query at the end of the keys sees every key up to its own column, where that key is a real token
        # (an additive finfo.min bias: a padding query's row is all min, uniform and never NaN)
        causal = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
        keep = causal[None] & key_real[:, None, :]
        bias = torch.zeros(keep.shape, dtype=q.dtype, device=x.device).masked_fill(~keep, torch.finfo(q.dtype).min)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, None])
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = SelfAttention(cfg, layer)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x, cache, key_real):
        x = x + self.attn(self.ln1(x), cache, key_real)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(64, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, input_ids, cache: KVCache, start: int):
        B, T = input_ids.shape
        real = input_ids != self.cfg.pad_token_id
        cache.real = real if cache.real is None else torch.cat([cache.real, real], dim=1)
        pos = torch.arange(start, start + T, device=input_ids.device).clamp(max=63)
        x = self.wte(input_ids) + self.wpe(pos)[None]
        for block in self.blocks:
            x = block(x, cache, cache.real)
        return self.head(self.ln_f(x))


@torch.no_grad()
def generate(model: GPT, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    cache = KVCache(model.cfg.n_layer)
    generated = prompts
    logits = model(generated, cache, start=0)
    for _ in range(new_tokens):
        next_token = logits[:, -1].argmax(-1, keepdim=True).clamp(min=1)
        generated = torch.cat([generated, next_token], dim=1)
        if FIXED:
            logits = model(generated[:, -1:], cache, start=generated.shape[1] - 1)
        else:
            logits = model(generated, cache, start=cache.k[0].shape[2])
    return generated


if __name__ == "__main__":
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg).eval()
    lengths = (5, 7, 6)
    prompts = torch.zeros(3, 7, dtype=torch.long)  # left-padded with pad_token_id 0
    for row, n in enumerate(lengths):
        prompts[row, 7 - n:] = torch.randint(1, cfg.vocab_size, (n,))
    out = generate(model, prompts, new_tokens=4)
    print("fixed" if FIXED else "buggy", out.tolist())
