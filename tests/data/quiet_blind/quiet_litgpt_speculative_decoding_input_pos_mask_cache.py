"""Speculative decoding as Lightning-AI/litgpt writes it, shrunk to tiny sizes.

Ported from Lightning-AI/litgpt:
  litgpt/generate/speculative_decoding.py @ b197569536594f7ab097d9b28cdb9cc630939a41
      (sample, speculative_decoding, generate)
  litgpt/model.py @ 04205815e8849fe883825e3e858e62749c5d7f4d (GPT.forward: mask = batched_index_select(mask_cache, 2, input_pos)
      then mask[..., :input_pos_maxp1]; CausalSelfAttention.forward: KVCache.forward
      index_copy_ at input_pos, then k/v sliced to input_pos_maxp1; build_mask_cache =
      tril(ones(bool)); SDPA with attn_mask=mask, is_causal=mask is None)

The draft model writes its guesses into its own static KV cache; the target verifies
k + 1 tokens in one cached forward. Nothing is ever rolled back: rows of the bool mask
cache picked at `input_pos` only let each query see keys at positions <= its own, and
`input_pos_maxp1` cuts the key axis, so rejected drafts left in the cache beyond the
accepted prefix are either hidden or overwritten by the next call.

Check: with top_k=1 the algorithm reduces to the target's greedy decoding, which is
recomputed here without any cache (full causal forward every step).  In addition every
cached forward of both models is compared with a cache-free full forward over the
tokens the cache holds at that moment.
"""

import copy
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    n_embd: int = 32
    n_head: int = 4
    n_query_groups: int = 2
    n_layer: int = 2
    padded_vocab_size: int = 48
    block_size: int = 64
    intermediate_size: int = 64
    norm_eps: float = 1e-5
    rope_base: int = 10000

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def rope_n_elem(self) -> int:
        return self.head_size


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        norm_x = torch.mean(x * x, dim=-1, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        return (x_normed * self.weight.float()).to(dtype=dtype)


def build_rope_cache(seq_len, n_elem, base=10000):
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2).float() / n_elem))
    seq_idx = torch.arange(seq_len).float()
    idx_theta = torch.outer(seq_idx, theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x, cos, sin):
    head_size_half = x.size(-1) // 2
    x1 = x[..., :head_size_half]
    x2 = x[..., head_size_half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    dims_diff = x.dim() - cos.dim()
    if dims_diff > 0:
        new_shape = cos.shape[0:1] + (1,) * dims_diff + cos.shape[1:]
        cos = cos.view(*new_shape)
        sin = sin.view(*new_shape)
    return ((x * cos) + (rotated * sin)).to(dtype=x.dtype)


def batched_index_select(t, dim, idx):
    """index_select for batched index and unbatched t"""
    if idx.dim() == 1:
        return torch.index_select(t, dim, idx)
    *batch_shape, idx_size = idx.shape
    res = torch.index_select(t, dim, idx.reshape(-1))
    res = res.view(*t.shape[:dim], -1, idx_size, *t.shape[dim + 1:])
    if dim > 0:
        dims = [dim] + list(range(res.dim()))
        del dims[dim + 1]
        res = res.permute(dims)
    return res.view(*batch_shape, *res.shape[1:])


def build_mask_cache(max_seq_length: int, device=None) -> torch.Tensor:
    ones = torch.ones((max_seq_length, max_seq_length), device=device, dtype=torch.bool)
    return torch.tril(ones).unsqueeze(0).unsqueeze(0)


class KVCache(nn.Module):
    def __init__(self, k_shape, v_shape) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(k_shape), persistent=False)
        self.register_buffer("v", torch.zeros(v_shape), persistent=False)

    def forward(self, input_pos, k, v):
        bs = k.size(0)
        k = self.k[:bs, ...].index_copy_(-2, input_pos, k)
        v = self.v[:bs, ...].index_copy_(-2, input_pos, v)
        return k, v


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.qkv = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_query_groups) * config.head_size, bias=False)
        self.proj = nn.Linear(config.head_size * config.n_head, config.n_embd, bias=False)
        self.kv_cache: Optional[KVCache] = None
        self.config = config

    def forward(self, x, cos, sin, mask=None, input_pos=None, input_pos_maxp1=None):
        head_size = self.config.head_size
        n_head = self.config.n_head
        n_query_groups = self.config.n_query_groups
        rope_n_elem = self.config.rope_n_elem
        B, T, C = x.size()
        qkv = self.qkv(x)
        query_size = n_head * head_size
        key_size = value_size = n_query_groups * head_size
        q, k, v = qkv.split((query_size, key_size, value_size), dim=-1)
        q = q.view(B, T, n_head, head_size).transpose(1, 2)
        k = k.view(B, T, n_query_groups, head_size).transpose(1, 2)
        v = v.view(B, T, n_query_groups, head_size).transpose(1, 2)

        q_roped = apply_rope(q[..., :rope_n_elem], cos, sin)
        k_roped = apply_rope(k[..., :rope_n_elem], cos, sin)
        q = torch.cat((q_roped, q[..., rope_n_elem:]), dim=-1)
        k = torch.cat((k_roped, k[..., rope_n_elem:]), dim=-1)

        if input_pos is not None:
            if not isinstance(self.kv_cache, KVCache):
                raise TypeError("You need to call `gpt.set_kv_cache()`")
            k, v = self.kv_cache(input_pos, k, v)
            if input_pos_maxp1 is not None:
                k = k[..., :input_pos_maxp1, :]
                v = v[..., :input_pos_maxp1, :]

        if n_query_groups != n_head and (input_pos is None or n_query_groups != 1):
            q_per_kv = n_head // n_query_groups
            k = k.repeat_interleave(q_per_kv, dim=1)
            v = v.repeat_interleave(q_per_kv, dim=1)

        y = self.scaled_dot_product_attention(q, k, v, mask)
        y = y.reshape(B, T, head_size * n_head)
        return self.proj(y)

    def scaled_dot_product_attention(self, q, k, v, mask=None):
        scale = 1.0 / math.sqrt(self.config.head_size)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=mask is None)
        return y.transpose(1, 2)

    def build_kv_cache(self, batch_size, max_seq_length):
        shape = (batch_size, self.config.n_query_groups, max_seq_length, self.config.head_size)
        return KVCache(shape, shape)


class LLaMAMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = LLaMAMLP(config)

    def forward(self, x, cos, sin, mask=None, input_pos=None, input_pos_maxp1=None):
        x = self.attn(self.norm_1(x), cos, sin, mask, input_pos, input_pos_maxp1) + x
        return self.mlp(self.norm_2(x)) + x


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=RMSNorm(config.n_embd, eps=config.norm_eps),
            )
        )
        self.mask_cache: Optional[torch.Tensor] = None
        self.max_seq_length = config.block_size
        cos, sin = build_rope_cache(self.max_seq_length, config.rope_n_elem, config.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx, input_pos=None, input_pos_maxp1=None):
        T = idx.size(1)
        if input_pos is not None:  # use the kv cache
            cos = batched_index_select(self.cos, 0, input_pos)
            sin = batched_index_select(self.sin, 0, input_pos)
            if input_pos.dim() == 1:
                cos = cos.unsqueeze(0)
                sin = sin.unsqueeze(0)
            if self.mask_cache is None:
                raise TypeError("You need to call `gpt.set_kv_cache()`")
            mask = batched_index_select(self.mask_cache, 2, input_pos)
            if mask.dim() > 4:
                mask = mask.view(*(mask.shape[0:1] + mask.shape[2:]))
            if input_pos_maxp1 is not None:
                if input_pos_maxp1 > self.max_seq_length:
                    raise ValueError(f"Positions in 'input_pos' must be in [0,{self.max_seq_length})")
                mask = mask[..., :input_pos_maxp1]
        else:
            cos = self.cos[:T].unsqueeze(0)
            sin = self.sin[:T].unsqueeze(0)
            mask = None  # defaults to causal mask
            input_pos_maxp1 = None

        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin, mask, input_pos, input_pos_maxp1)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)

    def set_kv_cache(self, batch_size: int, max_seq_length: Optional[int] = None) -> None:
        if max_seq_length is None:
            max_seq_length = self.max_seq_length
        for block in self.transformer.h:
            block.attn.kv_cache = block.attn.build_kv_cache(batch_size, max_seq_length)
        if self.mask_cache is None or self.mask_cache.size(3) != max_seq_length:
            self.mask_cache = build_mask_cache(max_seq_length)


# ---------------------------------------------------------------- litgpt/generate/base.py
def multinomial_num_samples_1(probs: torch.Tensor) -> torch.Tensor:
    return torch.multinomial(probs, num_samples=1)


def sample_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, sorted_indices = torch.sort(logits, descending=False)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_indices_to_remove = cumulative_probs <= (1 - top_p)
    sorted_indices_to_remove[-1:] = 0
    indices_to_remove = sorted_indices_to_remove.scatter(0, sorted_indices, sorted_indices_to_remove)
    return logits.masked_fill(indices_to_remove, float("-inf"))


def next_token(model, input_pos, x, input_pos_maxp1=None, **sample_kwargs):
    logits = model(x, input_pos, input_pos_maxp1=input_pos_maxp1)
    _next, _ = sample(logits, **sample_kwargs)
    return _next.to(dtype=torch.int64)


# ---------------------------------------------------- litgpt/generate/speculative_decoding.py
def sample(logits, temperature: float = 1.0, top_k: Optional[int] = None, top_p: float = 1.0, apply_softmax: bool = True):
    if top_p < 0.0 or top_p > 1.0:
        raise ValueError(f"top_p must be in [0, 1], got {top_p}")
    logits = logits[0, -1]
    if top_k is not None:
        v, i = torch.topk(logits, min(top_k, logits.size(-1)))
        fill_value = float("-inf") if apply_softmax else float(0)
        logits = torch.full_like(logits, fill_value).scatter_(-1, i, v)
    if temperature > 0.0 or top_p > 0.0:
        if temperature > 0.0:
            logits = logits / temperature
        if top_p < 1.0:
            logits = sample_top_p(logits, top_p)
        probs = F.softmax(logits, dim=-1) if apply_softmax else logits
        return multinomial_num_samples_1(probs), probs
    return torch.argmax(logits, dim=-1, keepdim=True), F.softmax(logits, dim=-1)


def speculative_decoding(draft_model, target_model, token, input_pos, input_pos_maxp1, speculative_k, **sample_kwargs):
    if speculative_k < 1:
        raise ValueError(f"speculative_k must be >= 1, got {speculative_k}")

    # Step 1: the draft model generates k tokens autoregressively through its KV cache
    draft_input_pos = input_pos.clone()
    draft_input_pos_maxp1 = input_pos_maxp1
    draft_tokens, draft_probs = [], []
    draft_token = token
    for idx in range(speculative_k):
        logits = draft_model(idx=draft_token.unsqueeze(0), input_pos=draft_input_pos, input_pos_maxp1=draft_input_pos_maxp1)
        draft_token, draft_prob = sample(logits, **sample_kwargs)
        draft_input_pos.add_(1)
        draft_input_pos_maxp1 += 1
        draft_tokens.append(draft_token)
        draft_probs.append(draft_prob)
    draft_tokens = torch.cat(draft_tokens)

    # Step 2: the target scores the current token and all drafts in one cached forward
    candidate_tokens = torch.cat((token, draft_tokens))
    candidate_input_pos = input_pos + torch.arange(0, speculative_k + 1, device=input_pos.device)
    candidate_input_pos_maxp1 = input_pos_maxp1 + speculative_k
    target_logits = target_model(idx=candidate_tokens.unsqueeze(0), input_pos=candidate_input_pos, input_pos_maxp1=candidate_input_pos_maxp1)

    # Step 3
    target_probs = []
    for target_logit in target_logits.split(1, dim=1):
        _, target_prob = sample(target_logit, **sample_kwargs)
        target_probs.append(target_prob)

    # Step 4: rejection sampling
    accepted_tokens = []
    for idx in range(len(draft_tokens)):
        draft_token = draft_tokens[idx].unsqueeze(0)
        draft_prob = draft_probs[idx][draft_token]
        target_prob = target_probs[idx][draft_token]
        if target_prob >= draft_prob:
            accepted_tokens.append(draft_token)
            continue
        discard_prob = 1 - target_prob / draft_prob
        should_discard_token = torch.rand(1, device=discard_prob.device) <= discard_prob
        if not should_discard_token:
            accepted_tokens.append(draft_token)
            continue
        adjusted_distribution = target_probs[idx] - draft_probs[idx]
        adjusted_distribution = torch.clamp(adjusted_distribution, 0.0)
        adjusted_distribution = adjusted_distribution / adjusted_distribution.sum()
        new_token, _ = sample(adjusted_distribution[None, None, ...], apply_softmax=False, **sample_kwargs)
        return torch.cat((*accepted_tokens, new_token))

    # all drafts accepted: feed the last draft to the draft model's cache, sample one more from the target
    draft_model(idx=draft_token.unsqueeze(0), input_pos=draft_input_pos, input_pos_maxp1=draft_input_pos_maxp1)
    new_token, _ = sample(target_logits, **sample_kwargs)
    return torch.cat((*accepted_tokens, new_token))


@torch.inference_mode()
def generate(draft_model, target_model, prompt, max_returned_tokens, *, temperature=1.0, top_k=None, top_p=1.0,
             stop_tokens=(), include_prompt=True, speculative_k: int):
    prompt_size = prompt.size(0)
    device = prompt.device
    assert max_returned_tokens > prompt_size

    # Step 1: prefill draft and target with the prompt
    input_pos = torch.arange(0, prompt_size, device=device, dtype=torch.int64)
    input_pos_maxp1 = prompt_size
    next_token(draft_model, input_pos, prompt.view(1, -1), input_pos_maxp1=input_pos_maxp1,
               temperature=temperature, top_k=top_k, top_p=top_p)
    token = next_token(target_model, input_pos, prompt.view(1, -1), input_pos_maxp1=input_pos_maxp1,
                       temperature=temperature, top_k=top_k, top_p=top_p)
    input_pos = torch.tensor([prompt_size], device=device, dtype=torch.int64)
    input_pos_maxp1 += 1

    # Step 2: main loop.  (The prefill token is kept in the output here; the upstream
    # function only collects the tokens returned by `speculative_decoding`.)
    tokens = [token[0]]
    total_generated, total_accepted = 0, 0
    while input_pos < max_returned_tokens - 1:
        _speculative_k = min(speculative_k, (max_returned_tokens - input_pos - 1).item())
        new_tokens = speculative_decoding(
            draft_model=draft_model, target_model=target_model, token=token, input_pos=input_pos,
            input_pos_maxp1=input_pos_maxp1, speculative_k=_speculative_k,
            temperature=temperature, top_k=top_k, top_p=top_p,
        )
        accepted_tokens_len = len(new_tokens)
        total_generated += _speculative_k
        total_accepted += accepted_tokens_len - 1
        should_break = False
        for new_token in new_tokens:
            if new_token in stop_tokens:
                should_break = True
                break
            tokens.append(new_token)
        if should_break:
            break
        input_pos.add_(accepted_tokens_len)
        input_pos_maxp1 += accepted_tokens_len
        token = new_tokens[-1].unsqueeze(0)

    tokens = torch.stack(tokens)
    if include_prompt:
        tokens = torch.cat([prompt, tokens])
    acceptance_rate = total_accepted / total_generated if total_generated > 0 else 0.0
    return tokens, acceptance_rate


# ------------------------------------------------------------------ independent checks
class CacheShadow:
    """Records which token each cache slot of a model holds and, after every cached
    forward, recomputes the same logits with a cache-free full causal forward."""

    def __init__(self, model: GPT, name: str):
        self.model = model
        self.name = name
        self.slots: Dict[int, int] = {}
        self.max_err = 0.0
        self.calls = 0
        self.orig_forward = model.forward
        model.forward = self.forward  # type: ignore[assignment]

    def forward(self, idx, input_pos=None, input_pos_maxp1=None):
        out = self.orig_forward(idx, input_pos, input_pos_maxp1)
        if input_pos is not None:
            for p, t in zip(input_pos.tolist(), idx[0].tolist()):
                self.slots[p] = t
            end = max(input_pos.tolist()) + 1
            seq = torch.tensor([[self.slots[p] for p in range(end)]])
            full = self.orig_forward(seq)  # no cache, mask None -> is_causal
            ref = full[:, input_pos]
            self.max_err = max(self.max_err, (ref - out).abs().max().item())
            self.calls += 1
        return out


@torch.inference_mode()
def greedy_reference(model: GPT, prompt: torch.Tensor, max_returned_tokens: int) -> torch.Tensor:
    seq = prompt.clone()
    while seq.numel() < max_returned_tokens:
        logits = model(seq.view(1, -1))  # full causal forward, no cache
        seq = torch.cat([seq, logits[0, -1].argmax().view(1)])
    return seq


def main() -> None:
    torch.manual_seed(0)
    config = Config()
    target = GPT(config).eval()
    for p in target.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.3)
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.add_(0.03 * torch.randn(p.shape, generator=g))

    prompt = torch.tensor([3, 17, 5, 29, 11, 40, 2], dtype=torch.int64)
    max_returned_tokens = 30
    for m in (draft, target):
        m.max_seq_length = max_returned_tokens
        m.set_kv_cache(batch_size=1)

    shadows = [CacheShadow(draft, "draft"), CacheShadow(target, "target")]
    out, acceptance = generate(draft, target, prompt, max_returned_tokens,
                               temperature=1.0, top_k=1, top_p=1.0, speculative_k=3)
    for s in shadows:
        s.model.forward = s.orig_forward  # type: ignore[assignment]

    ref = greedy_reference(target, prompt, out.numel())
    same_tokens = torch.equal(out, ref)
    logits_ok = all(s.max_err < 1e-4 for s in shadows)
    print(f"generated {out.numel() - prompt.numel()} tokens, acceptance rate {acceptance:.2f}")
    for s in shadows:
        print(f"  {s.name}: {s.calls} cached forwards, max |cached - full causal| = {s.max_err:.2e}")
    print("speculative output == target greedy without cache:", same_tokens)
    ok = same_tokens and logits_ok and 0.0 < acceptance < 1.0
    print("MATCH" if ok else "MISMATCH")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
