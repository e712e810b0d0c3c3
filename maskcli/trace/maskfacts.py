"""Facts about a mask read at a call (trace/masks.py asks): NaN or +inf added to the scores; of a float mask's rows
that see no key, which are NaN and which uniform; where nn.MultiheadAttention's merged mask adds -inf; and what F.multi_head_attention_forward dropped,
an attn_mask handed beside is_causal=True, which it replaces with SDPA's causal mask where it hands the call to SDPA;
whether a float mask added to the scores holds only 0s and 1s (a keep mask cast to float, which masks nothing)."""

from __future__ import annotations

import torch

from maskcli.inspect.polarity import additive_keep


NAME_DROPPED = 1 << 20  # cells of a dropped attn_mask named by the recogniser (past it: its differing cell only)
_DROPPED: dict = {}  # id(attn_mask) -> (a weak reference to it, its version, what _dropped found): one tensor every step


def note_zero_one(mask: torch.Tensor, details: dict, name: str | None = None) -> None:
    """details["zero_one"] (True, or the argument's `name` where not attn_mask) where `mask` is a float 0/1 mask added
    to the scores (zero_one)."""
    if zero_one(mask):
        details["zero_one"] = name or True


def row_constant(mask: torch.Tensor, keep: torch.Tensor) -> bool:
    """Every query row adds one value to all the keys it keeps (a (1, L) row of ones cast to float and added, as
    mlx-vlm#440's processor mask was): softmax is unchanged by a shift of its whole row, so the mask adds no bias."""
    low = torch.where(keep, mask, torch.full((), float("inf"), dtype=mask.dtype)).amin(dim=-1)
    high = torch.where(keep, mask, torch.full((), float("-inf"), dtype=mask.dtype)).amax(dim=-1)
    return bool(((low == high) | ~keep.any(dim=-1)).all())


def zero_one(mask: torch.Tensor) -> bool:
    """A float mask added to the scores that holds only 0s and 1s, some of each: a keep (or pad) mask cast to float
    and added as it is, which masks nothing (checks/kernels.py's ones-added; SDPA's and nn.MultiheadAttention's alike).
    One of 1s alone adds a constant, and one of 0s alone is no mask."""
    if not mask.is_floating_point():
        return False
    mask = mask.detach()
    zeros, ones = mask == 0, mask == 1
    return bool((zeros | ones).all()) and bool(zeros.any()) and bool(ones.any())


def dropped(attn_mask: torch.Tensor, batch: int, heads: int, q_len: int, k_len: int) -> dict | None:
    """What an attn_mask F.multi_head_attention_forward dropped for SDPA's is_causal (torch/nn/functional.py: "if
    is_causal and key_padding_mask is None and not need_weights: attn_mask = None") holds where it is not that causal
    mask (top-left, torch.tril): its name where the recogniser gives one, and its first differing cell (b, h, q, k)
    with whether attn_mask keeps it. None where it is causal: the hint was true and nothing was lost."""
    import weakref

    held = _DROPPED.get(id(attn_mask))
    if held is not None and held[0]() is attn_mask and not attn_mask.is_inference() and held[1] == attn_mask._version:
        return held[2]
    own = ~attn_mask if attn_mask.dtype == torch.bool else additive_keep(attn_mask.detach())
    own = own.reshape(batch, heads, q_len, -1) if own.dim() == 3 else own.reshape(1, 1, q_len, -1)
    causal = torch.ones((q_len, k_len), dtype=torch.bool, device=own.device).tril()
    differ = own ^ causal
    found = None
    if bool(differ.any()):
        b, h, q, k = (int(x) for x in differ.nonzero()[0])
        found = {"cell": [b, h, q, k], "keeps": bool(own[b, h, q, k]), "name": None}
        if own.numel() <= NAME_DROPPED:
            from maskcli.inspect.structure import recognise
            from maskcli.trace.names import flags

            structure = recognise(own.cpu().numpy())
            if structure.expression is not None:
                found["name"] = structure.expression + flags(structure.options, q_len, k_len)
    if len(_DROPPED) >= 64:
        _DROPPED.pop(next(iter(_DROPPED)))
    try:
        _DROPPED[id(attn_mask)] = (weakref.ref(attn_mask), None if attn_mask.is_inference() else attn_mask._version, found)
    except TypeError:  # (a tensor subclass without weak references: read again next time)
        pass
    return found


def empty_rows(keep: torch.Tensor, infinite: torch.Tensor, details: dict) -> None:
    """Of a float mask's rows that see no key, whether some are -inf everywhere (NaN out of a softmax: `nan_rows`) and
    whether some hold a finite fill (-1e8, -1e9: uniform weights over those keys, no NaN: `finite_rows`)."""
    empty = ~keep.any(dim=-1)
    if bool(empty.any()):
        every = infinite.all(dim=-1)
        details["nan_rows"] = bool((empty & every).any())
        details["finite_rows"] = bool((empty & ~every).any())


def infinite(attn_mask, padding, batch: int, heads: int, q_len: int, extra: int) -> torch.Tensor:
    """Where MHA's merged mask adds -inf: a bool mask's masked cells (it turns them into -inf) and a float one's -inf;
    never in the columns bias_k and add_zero_attn add."""
    def inf(x, shape):
        x = x.reshape(shape)
        x = x if x.dtype == torch.bool else x.detach() == float("-inf")
        return torch.cat([x, torch.zeros((*x.shape[:-1], extra), dtype=torch.bool, device=x.device)], -1) if extra else x
    out = torch.zeros((1, 1, q_len, 1), dtype=torch.bool, device=(attn_mask if attn_mask is not None else padding).device)
    if attn_mask is not None:
        out = out | inf(attn_mask, (batch, heads, q_len, -1) if attn_mask.dim() == 3 else (1, 1, q_len, -1))
    if padding is not None:
        out = out | inf(padding, (batch, 1, 1, -1))
    return out


def poison(mask: torch.Tensor, details: dict) -> None:
    """NaN or +inf added to the scores: read as masked (no weight is kept there), but softmax makes every row that
    holds one NaN, whatever else it sees (checks/fills.py says so, and rows.py what such a row gives)."""
    nan, inf = torch.isnan(mask), mask == float("inf")
    bad = nan | inf
    if bool(bad.any()):
        rows = bad.reshape(-1, mask.shape[-1]).any(dim=-1) if mask.dim() else bad.reshape(1)
        details["poison"] = {"value": "NaN" if bool(nan.any()) else "+inf", "cells": int(bad.sum()),
                             "rows": int(rows.sum()), "of": int(rows.numel())}


NAN_ROWS = 4096  # query rows (over batch rows, heads and queries, flat) whose NaN scores a call records


def nan_scores(scores: torch.Tensor, details: dict) -> None:
    """details["nan_scores"]: the flat query rows whose scores hold a NaN (an earlier call's rows that saw no key, come
    through: checks/nans.py). One amax first (it keeps a NaN): cell by cell only where there is one."""
    if scores.numel() and bool(torch.isnan(scores.amax())):
        nan = torch.isnan(scores).any(dim=-1).reshape(-1)
        details["nan_scores"] = torch.nonzero(nan).flatten()[:NAN_ROWS].tolist()


def attention_bias(mask) -> bool:
    """`mask` is one of torch's attention-bias objects (torch.nn.attention.bias.CausalBias): a tensor subclass whose
    cells exist only as its dispatch materialises them, and which SDPA hands on to that dispatch."""
    if mask is None or type(mask) is torch.Tensor or not isinstance(mask, torch.Tensor):
        return False
    from torch.nn.attention.bias import CausalBias

    return isinstance(mask, CausalBias)


def query_offset(q: torch.Tensor, k: torch.Tensor) -> int | None:
    """Where MHA's (L, B, E) query input starts among its key input, both views of one storage with the same strides
    (`attention(query=x[:, T:], key=x, value=x)`: TFT's decoder queries the forecast steps of the sequence it attends
    over); None where the query is not such a slice of the keys (checks/padqueries.py)."""
    try:
        if q.dim() != k.dim() or q.shape[1:] != k.shape[1:] or q.stride() != k.stride() or q.shape[0] >= k.shape[0]:
            return None
        step, offset = k.stride(0), q.storage_offset() - k.storage_offset()
    except (RuntimeError, NotImplementedError):  # (tensor subclasses: no storage to read)
        return None
    if step <= 0 or offset % step or not 0 <= offset // step <= k.shape[0] - q.shape[0]:
        return None
    return offset // step


def tril(q_len: int, k_len: int, like: torch.Tensor) -> torch.Tensor:
    """SDPA's is_causal as a bool (Lq, Lk) keep on `like`'s device: query row i sees keys 0..i (top-left)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=like.device).tril()


def frozen(intervals):
    """Intervals shared by every call of one shape: read-only, so that no caller changes another's."""
    intervals.starts.setflags(write=False)
    intervals.ends.setflags(write=False)
    return intervals
