"""litgpt: with attention-logit softcapping the boolean mask_cache is *added* to the scores.

Citation: Lightning-AI/litgpt issue #1672 "attention mask is incorrect when generate with
softcapping" (label bug; maintainers rasbt / Andrei-Aksionov confirmed: "It's indeed
could have been done better on my side. Like in pseudocode for SDPA, where if the mask
is a boolean, then another path is taken."). Issue text read; the fix commit was not
read -- `--fixed` takes SDPA's boolean path as the maintainer describes it (a bool mask
becomes an additive mask with -inf / finfo.min where it is False).

Bug: `build_mask_cache` makes `mask_cache` as `torch.bool` (tril of ones); in generation
`GPT.forward` hands `mask_cache.index_select(2, input_pos)` to
`CausalSelfAttention.scaled_dot_product_attention`, whose softcapping branch (Gemma-2,
which SDPA cannot do) computes `scores = scores + mask`: +1 where attending is allowed,
+0 where it is not, so nothing is masked -- prompt tokens see later prompt tokens and the
empty, zero-filled KV-cache slots.
Fix: convert the boolean mask before adding it.

Reproduction: litgpt-style `Config` dataclass (attention_logit_softcapping=50.0),
`build_mask_cache`, a `KVCache` of max_seq_length 8, `CausalSelfAttention` with the
softcapping branch; a 4-token prefill (input_pos = arange(4)) then two decode steps,
compared with a no-cache causal forward (mask None, the branch's own triu mask).
"""
import math
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class Config:
    n_embd: int = 32
    n_head: int = 4
    head_size: int = 8
    block_size: int = 8
    attention_logit_softcapping: Optional[float] = 50.0
    attention_scores_scalar: Optional[int] = None


def build_mask_cache(max_seq_length: int, device: Optional[torch.device] = None) -> torch.Tensor:
    ones = torch.ones((max_seq_length, max_seq_length), device=device, dtype=torch.bool)
    return torch.tril(ones).unsqueeze(0).unsqueeze(0)


def do_softcapping(x: torch.Tensor, thresh: float) -> torch.Tensor:
    return torch.tanh(x / thresh) * thresh


class KVCache(nn.Module):
    def __init__(self, k_shape, v_shape):
        super().__init__()
        self.register_buffer("k", torch.zeros(k_shape), persistent=False)
        self.register_buffer("v", torch.zeros(v_shape), persistent=False)

    def forward(self, input_pos, k, v):
        self.k = self.k.index_copy_(2, input_pos, k)
        self.v = self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.attn = nn.Linear(config.n_embd, 3 * config.n_head * config.head_size, bias=False)
        self.proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=False)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x, mask=None, input_pos=None):
        B, T, C = x.size()
        qkv = self.attn(x).view(B, T, 3, self.config.n_head, self.config.head_size)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, nh, T, hs)
        if input_pos is not None:
            k, v = self.kv_cache(input_pos, k, v)
        y = self.scaled_dot_product_attention(q, k, v, mask)
        y = y.reshape(B, T, self.config.head_size * self.config.n_head)
        return self.proj(y)

    def scaled_dot_product_attention(self, q, k, v, mask=None):
        scale = 1.0 / math.sqrt(self.config.attention_scores_scalar or self.config.head_size)
        # with softcapping we cannot use SDPA
        if self.config.attention_logit_softcapping is not None:
            scores = q @ k.mT * scale
            scores = do_softcapping(scores, self.config.attention_logit_softcapping)
            if mask is None:
                mask = torch.ones(q.size(2), q.size(2), dtype=q.dtype, device=q.device).triu(diagonal=1)
                mask.masked_fill_(mask.bool(), torch.finfo(q.dtype).min)
            elif FIXED and mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                    mask.logical_not(), torch.finfo(q.dtype).min)
            scores = scores + mask
            scores = F.softmax(scores, dim=-1, dtype=torch.float).to(dtype=q.dtype)
            y = scores @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale,
                                               is_causal=mask is None)
        return y.transpose(1, 2)


class GPT(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.attn = CausalSelfAttention(config)
        self.max_seq_length = config.block_size
        self.mask_cache: Optional[torch.Tensor] = None

    def set_kv_cache(self, batch_size):
        shape = (batch_size, self.config.n_head, self.max_seq_length, self.config.head_size)
        self.attn.kv_cache = KVCache(shape, shape)
        self.mask_cache = build_mask_cache(self.max_seq_length)

    def forward(self, x, input_pos=None):
        if input_pos is not None:  # use the kv cache
            mask = self.mask_cache.index_select(2, input_pos)
            mask = mask[:, :, :, :self.max_seq_length]
        else:
            mask = None
        return self.attn(x, mask, input_pos)


def main():
    torch.manual_seed(0)
    model = GPT(Config()).eval()
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        full = model(x)
        model.set_kv_cache(batch_size=1)
        prefill = model(x[:, :4], input_pos=torch.arange(4))
        steps = [model(x[:, t:t + 1], input_pos=torch.tensor([t])) for t in (4, 5)]
    cached = torch.cat([prefill] + steps, dim=1)
    diff = (cached - full).abs().max().item()
    print("fixed" if FIXED else "buggy", "kv-cache generate vs causal forward max diff:", f"{diff:.2e}")


if __name__ == "__main__":
    main()
