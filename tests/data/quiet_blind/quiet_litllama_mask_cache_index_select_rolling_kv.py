"""lit-llama's KV-cached generation: causal mask rows picked from a block_size mask cache.

Port of Lightning-AI/lit-llama @2a464de2a1d2f266614d15091d3d7f30330c3ede:
  lit_llama/model.py  LLaMA.forward (mask_cache.index_select(2, input_pos)[..., :max_seq_length]),
                      LLaMA.build_mask_cache (tril of ones, bool, block_size x block_size),
                      CausalSelfAttention.forward (preallocated zero KV cache written with
                      index_copy at input_pos; once input_pos reaches max_seq_length the
                      cache is rolled left by one and the new key goes in the last slot),
                      build_rope_cache / apply_rope, RMSNorm, MLP
  generate.py         generate() (prefill with input_pos = arange(T), then one token at a
                      time with input_pos = input_pos[-1:] + 1); sampling replaced by argmax.
The bool mask goes to F.scaled_dot_product_attention (True = attend). Unwritten (zero)
cache slots sit to the right of input_pos and are hidden by the tril row; once the cache
rolls, the row selected for input_pos >= max_seq_length is all True over the
max_seq_length slots, i.e. a sliding window over the last max_seq_length tokens.
Checked against a full-sequence forward with no cache and an explicit
band mask (key j visible from query i iff i - max_seq_length < j <= i), loop over queries.
"""
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from torch.nn import functional as F

torch.manual_seed(0)


def find_multiple(n: int, k: int) -> int:
    if n % k == 0:
        return n
    return n + k - (n % k)


@dataclass
class LLaMAConfig:
    block_size: int = 32
    vocab_size: int = 64
    padded_vocab_size: Optional[int] = None
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32

    def __post_init__(self):
        if self.padded_vocab_size is None:
            self.padded_vocab_size = find_multiple(self.vocab_size, 64)


class RMSNorm(nn.Module):
    def __init__(self, size: int, dim: int = -1, eps: float = 1e-5) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.dim = dim

    def forward(self, x):
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        return self.scale * x_normed


def build_rope_cache(seq_len, n_elem, dtype, device, base=10000):
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=dtype, device=device) / n_elem))
    seq_idx = torch.arange(seq_len, dtype=dtype, device=device)
    idx_theta = torch.outer(seq_idx, theta).float()
    cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
    if dtype in (torch.float16, torch.bfloat16, torch.int8):
        cache = cache.half()
    return cache


def apply_rope(x, rope_cache):
    T = x.size(1)
    rope_cache = rope_cache[:T]
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    rope_cache = rope_cache.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
        ],
        -1,
    )
    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: LLaMAConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.block_size = config.block_size

    def forward(self, x, rope, mask, max_seq_length, input_pos=None, kv_cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        head_size = C // self.n_head
        k = k.view(B, T, self.n_head, head_size)
        q = q.view(B, T, self.n_head, head_size)
        v = v.view(B, T, self.n_head, head_size)
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
        k = k.transpose(1, 2)
        q = q.transpose(1, 2)
        v = v.transpose(1, 2)
        if kv_cache is not None:
            cache_k, cache_v = kv_cache
            if input_pos[-1] >= max_seq_length:
                input_pos = torch.tensor(max_seq_length - 1, device=input_pos.device)
                cache_k = torch.roll(cache_k, -1, dims=2)
                cache_v = torch.roll(cache_v, -1, dims=2)
            k = cache_k.index_copy(2, input_pos, k)
            v = cache_v.index_copy(2, input_pos, v)
            kv_cache = k, v
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.c_proj(y)
        return y, kv_cache


class MLP(nn.Module):
    def __init__(self, config: LLaMAConfig) -> None:
        super().__init__()
        hidden_dim = 4 * config.n_embd
        n_hidden = int(2 * hidden_dim / 3)
        n_hidden = find_multiple(n_hidden, 32)
        self.c_fc1 = nn.Linear(config.n_embd, n_hidden, bias=False)
        self.c_fc2 = nn.Linear(config.n_embd, n_hidden, bias=False)
        self.c_proj = nn.Linear(n_hidden, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.silu(self.c_fc1(x)) * self.c_fc2(x))


class Block(nn.Module):
    def __init__(self, config: LLaMAConfig) -> None:
        super().__init__()
        self.rms_1 = RMSNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.rms_2 = RMSNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, rope, mask, max_seq_length, input_pos=None, kv_cache=None):
        h, new_kv_cache = self.attn(self.rms_1(x), rope, mask, max_seq_length, input_pos, kv_cache)
        x = x + h
        x = x + self.mlp(self.rms_2(x))
        return x, new_kv_cache


class LLaMA(nn.Module):
    def __init__(self, config: LLaMAConfig) -> None:
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=RMSNorm(config.n_embd),
        ))
        self.rope_cache = None
        self.mask_cache = None
        self.kv_caches: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, idx, max_seq_length=None, input_pos=None):
        B, T = idx.size()
        block_size = self.config.block_size
        if max_seq_length is None:
            max_seq_length = block_size
        assert T <= max_seq_length
        assert max_seq_length <= block_size
        if self.rope_cache is None:
            self.rope_cache = self.build_rope_cache(idx)
        if self.mask_cache is None:
            self.mask_cache = self.build_mask_cache(idx)
        if input_pos is not None:
            rope = self.rope_cache.index_select(0, input_pos)
            mask = self.mask_cache.index_select(2, input_pos)
            mask = mask[:, :, :, :max_seq_length]
        else:
            rope = self.rope_cache[:T]
            mask = self.mask_cache[:, :, :T, :T]
        x = self.transformer.wte(idx)
        if input_pos is None:
            for block in self.transformer.h:
                x, _ = block(x, rope, mask, max_seq_length)
        else:
            if not self.kv_caches:
                head_size = self.config.n_embd // self.config.n_head
                cache_shape = (B, self.config.n_head, max_seq_length, head_size)
                self.kv_caches = [
                    (torch.zeros(cache_shape, dtype=x.dtype), torch.zeros(cache_shape, dtype=x.dtype))
                    for _ in range(self.config.n_layer)
                ]
            for i, block in enumerate(self.transformer.h):
                x, self.kv_caches[i] = block(x, rope, mask, max_seq_length, input_pos, self.kv_caches[i])
        x = self.transformer.ln_f(x)
        return self.lm_head(x)

    def build_rope_cache(self, idx):
        return build_rope_cache(seq_len=self.config.block_size,
                                n_elem=self.config.n_embd // self.config.n_head,
                                dtype=idx.dtype, device=idx.device)

    def build_mask_cache(self, idx):
        ones = torch.ones((self.config.block_size, self.config.block_size), device=idx.device, dtype=torch.bool)
        return torch.tril(ones).unsqueeze(0).unsqueeze(0)

    def reset_cache(self):
        self.kv_caches.clear()


@torch.no_grad()
def generate(model, idx, max_new_tokens, *, max_seq_length=None):
    """generate.py, with argmax instead of multinomial sampling; also returns step logits."""
    T = idx.size(0)
    T_new = T + max_new_tokens
    if max_seq_length is None:
        max_seq_length = min(T_new, model.config.block_size)
    empty = torch.empty(T_new, dtype=idx.dtype)
    empty[:T] = idx
    idx = empty
    input_pos = torch.arange(0, T)
    step_logits = []
    for _ in range(max_new_tokens):
        x = idx.index_select(0, input_pos).view(1, -1)
        logits = model(x, max_seq_length, input_pos)
        logits = logits[0, -1]
        step_logits.append(logits)
        idx_next = logits.argmax().view(1).to(dtype=idx.dtype)
        input_pos = input_pos[-1:] + 1
        idx = idx.index_copy(0, input_pos, idx_next)
    return idx, torch.stack(step_logits)


@torch.no_grad()
def reference_logits(model, seq, window):
    """No cache: full sequence, attention written as a loop over queries with a band."""
    cfg = model.config
    T = seq.shape[0]
    hs = cfg.n_embd // cfg.n_head
    rope = model.build_rope_cache(seq.view(1, -1))[:T]
    x = model.transformer.wte(seq.view(1, -1))
    for block in model.transformer.h:
        a = block.attn
        q, k, v = a.c_attn(block.rms_1(x)).split(cfg.n_embd, dim=2)
        q = apply_rope(q.view(1, T, cfg.n_head, hs), rope)[0]
        k = apply_rope(k.view(1, T, cfg.n_head, hs), rope)[0]
        v = v.view(T, cfg.n_head, hs)
        out = torch.zeros(T, cfg.n_head, hs)
        for i in range(T):
            lo = max(0, i - window + 1)
            sc = torch.einsum("hd,jhd->hj", q[i], k[lo:i + 1]) / math.sqrt(hs)
            out[i] = torch.einsum("hj,jhd->hd", sc.softmax(-1), v[lo:i + 1])
        x = x + a.c_proj(out.reshape(1, T, cfg.n_embd))
        x = x + block.mlp(block.rms_2(x))
    return model.lm_head(model.transformer.ln_f(x))[0]


def main():
    config = LLaMAConfig()
    model = LLaMA(config).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.05) + (1.0 if p.dim() == 1 else 0.0))
    prompt = torch.tensor([3, 17, 42, 8, 25], dtype=torch.long)
    ok = True
    # (a) max_seq_length defaults to T_new: the cache never rolls, plain causal.
    # (b) max_seq_length = 7 < T_new: the cache rolls, keys older than 7 tokens drop out.
    for max_new, msl in ((6, None), (10, 7)):
        model.reset_cache()
        seq, step_logits = generate(model, prompt, max_new, max_seq_length=msl)
        window = msl if msl is not None else seq.shape[0]
        ref = reference_logits(model, seq, window)[prompt.shape[0] - 1:-1]
        err = (ref - step_logits).abs().max().item()
        ok &= err < 1e-4
        print(f"max_seq_length={msl}: tokens {seq.tolist()}, max |diff| vs uncached band reference = {err:.2e}")
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
