# LitGPT (Lightning-AI/litgpt#2182, fixed by PR #2215, commit d28a00d8): with a sliding-window ring-buffer KVCache,
# a prefill longer than the window overwrites cache slots while the mask (global tril from build_mask_cache, only
# truncated by length) is not rebuilt from absolute positions, so early queries attend to future keys.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Config:
    n_embd = 32
    n_head = 4
    n_query_groups = 4
    head_size = 8
    n_layer = 2
    vocab_size = 64
    block_size = 32
    sliding_window_size = 6
    sliding_window_indices = [1, 1]
    rope_base = 10000


def build_rope_cache(seq_len, n_elem, base=10000):
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2).float() / n_elem))
    idx_theta = torch.outer(torch.arange(seq_len).float(), theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x, cos, sin):
    head_size = x.size(-1)
    x1 = x[..., : head_size // 2]
    x2 = x[..., head_size // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    if cos.dim() > 1:
        cos = cos.unsqueeze(-3)
        sin = sin.unsqueeze(-3)
    return (x * cos) + (rotated * sin)


def batched_index_select(t, dim, idx):
    """index_select for batched index and unbatched t"""
    if idx.dim() == 1:
        return torch.index_select(t, dim, idx)
    raise NotImplementedError


def batched_index_copy_(t, dim, idx, val):
    """Index copy for batched t, idx, val"""
    if idx.dim() == 1:
        return t.index_copy_(dim, idx, val)
    raise NotImplementedError


def build_mask_cache(max_seq_length, device=None):
    ones = torch.ones((max_seq_length, max_seq_length), device=device, dtype=torch.bool)
    return torch.tril(ones).unsqueeze(0).unsqueeze(0)


class KVCache(nn.Module):
    def __init__(self, k_shape, v_shape, is_sliding_window=False, sliding_window_size=None):
        super().__init__()
        self.register_buffer("k", torch.zeros(k_shape), persistent=False)
        self.register_buffer("v", torch.zeros(v_shape), persistent=False)
        self.is_sliding_window = is_sliding_window
        self.sliding_window_size = sliding_window_size
        self.max_cache_len = k_shape[2]

    def forward(self, input_pos, k, v):
        bs = k.size(0)
        if self.is_sliding_window:
            # Circular buffer for sliding window
            if FIXED:
                prefill_len = input_pos.shape[-1]
                if prefill_len > self.max_cache_len:
                    raise ValueError(
                        f"Prefill length ({prefill_len}) exceeds the sliding window size ({self.max_cache_len}). "
                        f"Please use chunked prefill with chunk size <= {self.max_cache_len} to avoid this issue."
                    )
            cache_positions = input_pos % self.max_cache_len
            k = batched_index_copy_(self.k[:bs, ...], -2, cache_positions, k)
            v = batched_index_copy_(self.v[:bs, ...], -2, cache_positions, v)

            max_pos = input_pos.max().item()
            if max_pos < self.max_cache_len:
                k = k[:, :, : max_pos + 1, :]
                v = v[:, :, : max_pos + 1, :]
        else:
            k = batched_index_copy_(self.k[:bs, ...], -2, input_pos, k)
            v = batched_index_copy_(self.v[:bs, ...], -2, input_pos, v)
        return k, v


class CausalSelfAttention(nn.Module):
    def __init__(self, config, block_idx):
        super().__init__()
        self.config = config
        shape = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.qkv = nn.Linear(config.n_embd, shape, bias=False)
        self.proj = nn.Linear(config.head_size * config.n_head, config.n_embd, bias=False)
        self.kv_cache = None
        self.apply_sliding_window_attention = False
        if config.sliding_window_size is not None and config.sliding_window_indices is not None:
            self.apply_sliding_window_attention = config.sliding_window_indices[block_idx]

    def forward(self, x, cos, sin, mask=None, input_pos=None, input_pos_maxp1=None):
        head_size, n_head = self.config.head_size, self.config.n_head
        B, T, _ = x.size()
        q, k, v = self.qkv(x).split([n_head * head_size] * 3, dim=-1)
        q = q.view(B, T, n_head, head_size).transpose(1, 2)
        k = k.view(B, T, n_head, head_size).transpose(1, 2)
        v = v.view(B, T, n_head, head_size).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)

        # Apply kv-cache during inference.
        if input_pos is not None:
            k, v = self.kv_cache(input_pos, k, v)

            if self.apply_sliding_window_attention:
                actual_kv_len = k.size(2)
                if mask is not None and mask.size(-1) != actual_kv_len:
                    mask = mask[..., :actual_kv_len]

            if input_pos_maxp1 is not None:
                k = k[..., :input_pos_maxp1, :]
                v = v[..., :input_pos_maxp1, :]

        if self.apply_sliding_window_attention:
            if input_pos is None:
                if mask is None:
                    mask = torch.ones(T, T, dtype=q.dtype, device=q.device).triu(diagonal=1)
                    mask.masked_fill_(mask.bool(), float("-inf"))
                    mask = mask.view(1, 1, *mask.shape)

                sliding_window_mask = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device)
                for i in range(T):
                    window_start = max(0, i - self.config.sliding_window_size + 1)
                    sliding_window_mask[i, window_start : i + 1] = 0.0
                sliding_window_mask = sliding_window_mask.view(1, 1, T, T)
                mask = sliding_window_mask

        y = self.scaled_dot_product_attention(q, k, v, mask)
        y = y.reshape(B, T, head_size * n_head)
        return self.proj(y)

    def scaled_dot_product_attention(self, q, k, v, mask=None):
        scale = 1.0 / math.sqrt(self.config.head_size)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=mask is None)
        return y.transpose(1, 2)

    def build_kv_cache(self, batch_size, max_seq_length):
        effective_cache_size = max_seq_length
        if self.apply_sliding_window_attention and self.config.sliding_window_size is not None:
            effective_cache_size = min(max_seq_length, self.config.sliding_window_size)
        shape = (batch_size, self.config.n_query_groups, effective_cache_size, self.config.head_size)
        return KVCache(
            shape,
            shape,
            is_sliding_window=self.apply_sliding_window_attention,
            sliding_window_size=self.config.sliding_window_size if self.apply_sliding_window_attention else None,
        )


class Block(nn.Module):
    def __init__(self, config, block_idx):
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, block_idx)
        self.norm_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(), nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x, cos, sin, mask=None, input_pos=None, input_pos_maxp1=None):
        x = x + self.attn(self.norm_1(x), cos, sin, mask, input_pos, input_pos_maxp1)
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.max_seq_length = config.block_size
        self.cos, self.sin = build_rope_cache(config.block_size, config.head_size, config.rope_base)
        self.mask_cache = None

    def set_kv_cache(self, batch_size, max_seq_length=None):
        max_seq_length = max_seq_length or self.max_seq_length
        for block in self.transformer.h:
            block.attn.kv_cache = block.attn.build_kv_cache(batch_size, max_seq_length)
        self.mask_cache = build_mask_cache(max_seq_length)

    def forward(self, idx, input_pos=None, input_pos_maxp1=None):
        T = idx.size(1)
        if input_pos is not None:  # use the kv cache
            cos = batched_index_select(self.cos, 0, input_pos).unsqueeze(0)
            sin = batched_index_select(self.sin, 0, input_pos).unsqueeze(0)
            mask = batched_index_select(self.mask_cache, 2, input_pos)
            if input_pos_maxp1 is not None:
                mask = mask[..., :input_pos_maxp1]
        else:
            cos = self.cos[:T].unsqueeze(0)
            sin = self.sin[:T].unsqueeze(0)
            mask = None
            input_pos_maxp1 = None
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin, mask, input_pos, input_pos_maxp1)
        return self.lm_head(self.transformer.ln_f(x))


config = Config()
model = GPT(config).eval()
T = 14  # prompt longer than sliding_window_size = 6
prompt = torch.randint(0, config.vocab_size, (1, T))

with torch.no_grad():
    ref = model(prompt)  # no KV cache: explicit sliding-window mask per query

    model.set_kv_cache(batch_size=1)
    input_pos = torch.arange(0, T)
    try:
        # litgpt.generate.base: prefill the whole prompt in one forward
        cached = model(prompt, input_pos, input_pos_maxp1=T)
        how = "single prefill"
    except ValueError as e:
        # follow the guidance of the error: chunked prefill with chunk size <= window (here 1 token)
        model.set_kv_cache(batch_size=1)
        outs = []
        for t in range(T):
            outs.append(model(prompt[:, t : t + 1], input_pos[t : t + 1], input_pos_maxp1=t + 1))
        cached = torch.cat(outs, dim=1)
        how = "chunked prefill after ValueError"

diff = (cached - ref).abs().max().item()
print(f"{how}: max |logits(kv-cache prefill) - logits(no cache)| = {diff:.6f}")
