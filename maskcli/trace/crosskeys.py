"""What a memory handed to an attention holds, for trace/crossing.py: a cache object of the memory's projected keys
(Dia's `cross_attn_cache`), or a packed kv that holds the queries' own keys and values (flash-attn's MHA)."""

from __future__ import annotations

import torch


def held_keys(value, k_len: int, inner: list) -> str | None:
    """The name of a tensor `value` (an object or dict handed under a memory's name: a cache of the memory's keys and
    values) holds as an attribute or entry whose length along dim -2 is the call's `k_len` and that a frame within
    (`inner`: the functions it handed them to, down to the kernel) holds as is: the keys the kernel attends are that
    memory's."""
    try:
        own = value if type(value) is dict else vars(value)  # (a dict of the memory's keys and values, or an object)
    except TypeError:  # (no __dict__: a tuple, a slotted object; nothing read)
        return None
    held = {id(t): str(n) for n, t in own.items() if issubclass(type(t), torch.Tensor) and t.dim() >= 2
            and t.shape[-2] == k_len}
    if not held:
        return None
    for frame in inner:
        for local in frame.f_locals.values():
            if id(local) in held and issubclass(type(local), torch.Tensor):
                return held[id(local)]
    return None


def packed_own(query: torch.Tensor, kv: torch.Tensor) -> bool:
    """`query` is the first of a packed qkv (flash-attn's (B, S, 3, H, D): `qkv[:, :, 0]`) and `kv`'s last S rows hold
    the other two: the layer's own keys and values, joined to its cache (flash-attn's MHA hands its self-attention's
    cache to its `inner_cross_attn(q, kv)`)."""
    base = query._base
    try:
        if base is None or base.dim() != kv.dim() or base.dim() < 3:
            return False
        packs = [d for d in range(base.dim()) if base.shape[d] == 3 and kv.shape[d] == 2]
        rows = [d for d in range(base.dim()) if d not in packs and base.shape[d] != kv.shape[d]]
        if len(packs) != 1 or len(rows) > 1:
            return False
        own = base.narrow(packs[0], 1, 2)
        if rows:
            length = own.shape[rows[0]]
            if kv.shape[rows[0]] < length:
                return False
            kv = kv.narrow(rows[0], kv.shape[rows[0]] - length, length)
        return kv.shape == own.shape and bool(torch.equal(kv, own))
    except (RuntimeError, NotImplementedError):  # (tensor subclasses, meta tensors: nothing to compare)
        return False
