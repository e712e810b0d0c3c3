"""ExecuTorch eager reference KV cache: a chunked/multi-turn prefill used SDPA's upper-left is_causal.

Citation: pytorch/executorch#21749 "Fix off-graph KV-cache causal alignment: add explicit masks"
(merged 2026-08-11). PR text: "the reference declared CAUSAL for every multi-token step and attend()
applied torch's is_causal, which is upper-left aligned when the query and key lengths differ, while
the design's causal is lower-right (new tokens at the tail of the read window ...). So a chunked or
multi-turn prefill hid the prior context: the second chunk's first query attended key 0 alone instead
of the whole history."

Bug: `SequenceReferenceCache.update_and_fetch` returned `MaskKind.NONE` for q_len == 1 and
`MaskKind.CAUSAL` for any other step; `attend` maps CAUSAL to `is_causal=True`.
Fix: `_spec` returns CAUSAL only when `q_len == total` (a fresh prefill) and otherwise an EXPLICIT bool
band `arange(total) - arange(q_len)[:, None] <= total - q_len`, passed as `attn_mask`. (The fixed
`_spec` / `attend` were read from upstream extension/llm/cache/reference_cache.py; the pre-fix
branch is reconstructed from the PR description.)

This program: a two-layer GQA decoder driving the reference cache through a chat: turn 1 (5-token
prompt, 2 decode steps) then turn 2 (a 4-token user message appended as one continuation step).
"""
import sys
from dataclasses import dataclass
from enum import Enum
from typing import List, Optional

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


class CacheSizing(Enum):
    STATIC = "static"
    DYNAMIC = "dynamic"


class MaskKind(Enum):
    NONE = "none"  # decode: q_len == 1, the single query sees all of history
    CAUSAL = "causal"  # prefill/continuation: query i sees keys up to its position
    EXPLICIT = "explicit"  # anything the other two cannot express: a mask tensor


@dataclass
class AttendSpec:
    k: torch.Tensor  # [B, H_kv, total, head_dim] -- key history
    v: torch.Tensor  # [B, H_kv, total, v_head_dim] -- value history
    kind: MaskKind
    q_len: int
    mask: Optional[torch.Tensor] = None  # EXPLICIT only: bool, true = attend


@dataclass
class CacheConfig:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    capacity: int  # hard bound in cells; the cache never exceeds it
    sizing: CacheSizing = CacheSizing.DYNAMIC
    dtype: torch.dtype = torch.float32
    batch_size: int = 1


class SequenceReferenceCache:
    """Per-layer contiguous float KV history for a single sequence."""

    def __init__(self, config: CacheConfig):
        self.config = config
        self._k: List[torch.Tensor] = []
        self._v: List[torch.Tensor] = []
        self._used: List[int] = [0] * config.n_layers
        b, h, d = config.batch_size, config.n_kv_heads, config.head_dim
        init_len = config.capacity if config.sizing == CacheSizing.STATIC else 0
        for _ in range(config.n_layers):
            self._k.append(torch.zeros(b, h, init_len, d, dtype=config.dtype))
            self._v.append(torch.zeros(b, h, init_len, d, dtype=config.dtype))

    def update_and_fetch(self, layer_id, k, v, position) -> List[AttendSpec]:
        """Place this step's K/V and return what to attend over."""
        q_len = k.shape[-2]
        used = self._used[layer_id]
        new_used = used + q_len
        if new_used > self.config.capacity:
            raise RuntimeError(f"KV cache overflow on layer {layer_id}")
        if self.config.sizing == CacheSizing.STATIC:
            self._k[layer_id][:, :, used:new_used, :] = k
            self._v[layer_id][:, :, used:new_used, :] = v
            k_hist = self._k[layer_id][:, :, :new_used, :]
            v_hist = self._v[layer_id][:, :, :new_used, :]
        else:
            self._k[layer_id] = torch.cat([self._k[layer_id], k], dim=2)
            self._v[layer_id] = torch.cat([self._v[layer_id], v], dim=2)
            k_hist, v_hist = self._k[layer_id], self._v[layer_id]
        self._used[layer_id] = new_used
        if not FIXED:
            kind = MaskKind.NONE if q_len == 1 else MaskKind.CAUSAL
            return [AttendSpec(k=k_hist, v=v_hist, kind=kind, q_len=q_len)]
        return [self._spec(k_hist, v_hist, q_len)]

    def _spec(self, k_hist, v_hist, q_len) -> AttendSpec:
        """The mask semantic for q_len new cells at the tail of a total window."""
        total = k_hist.shape[-2]
        if q_len == 1:
            return AttendSpec(k=k_hist, v=v_hist, kind=MaskKind.NONE, q_len=q_len)
        if q_len == total:
            return AttendSpec(k=k_hist, v=v_hist, kind=MaskKind.CAUSAL, q_len=q_len)
        # torch's is_causal is upper-left, so the band is handed back explicitly.
        device = k_hist.device
        offsets = torch.arange(total, device=device) - torch.arange(q_len, device=device).unsqueeze(-1)
        band = offsets <= total - q_len
        return AttendSpec(k=k_hist, v=v_hist, kind=MaskKind.EXPLICIT, q_len=q_len, mask=band)


def attend(q, spec: AttendSpec, scale, out_dtype):
    """Eager attend mechanism: SDPA over fetched K/V per the mask semantic."""
    k, v = spec.k, spec.v
    n_q_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_q_heads != n_kv_heads:
        rep = n_q_heads // n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q.to(torch.float32), k.to(torch.float32), v.to(torch.float32),
        attn_mask=spec.mask if spec.kind == MaskKind.EXPLICIT else None,
        is_causal=spec.kind == MaskKind.CAUSAL, scale=scale)
    return out.to(out_dtype)


def update_and_attend(cache, layer_id, q, k, v, position, scale):
    """Eager body of the `kvcache::update_and_attend` op."""
    outs, start = [], 0
    for spec in cache.update_and_fetch(layer_id, k, v, position):
        outs.append(attend(q[:, :, start:start + spec.q_len], spec, scale, q.dtype))
        start += spec.q_len
    return torch.cat(outs, dim=2)


class Attention(torch.nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, layer_id):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.layer_id = layer_id
        self.wq = torch.nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = torch.nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = torch.nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cache, position):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        out = update_and_attend(cache, self.layer_id, q, k, v, position, self.head_dim ** -0.5)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Transformer(torch.nn.Module):
    def __init__(self, vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=2):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Attention(dim, n_heads, n_kv_heads, i) for i in range(n_layers))
        self.output = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, cache, position):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = h + layer(h, cache, position)
        return self.output(h)


def main():
    model = Transformer().eval()
    cache = SequenceReferenceCache(CacheConfig(n_layers=2, n_kv_heads=2, head_dim=8, capacity=32))
    pos = 0
    replies = []
    with torch.no_grad():
        for turn in (torch.tensor([[1, 7, 3, 9, 4]]), torch.tensor([[12, 5, 30, 2]])):
            n = turn.shape[1]
            position = torch.arange(pos, pos + n).unsqueeze(-1)
            logits = model(turn, cache, position)
            pos += n
            reply = []
            for _ in range(2):
                nxt = logits[:, -1].argmax(-1, keepdim=True)
                reply.append(nxt.item())
                logits = model(nxt, cache, torch.tensor([[pos]]))
                pos += 1
            replies.append(reply)
    print("replies per turn:", replies)


if __name__ == "__main__":
    main()
