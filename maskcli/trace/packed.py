"""Packed documents handed to an inner module of the model: by keyword, or in an argument object.

An encoder that builds its `cu_seqlens` inside its forward and hands them to each layer by keyword (Qwen2-VL's,
Qwen3-ASR's), or a model that hands a packed-sequence object from layer to layer positionally (Megatron's
`PackedSeqParams`), states documents the model call's arguments do not hold: each attention call made inside such a
module gets them (details["documents"], checks/varlen.py) with how many tokens that module attends over
(details["documents_over"], checks/expanded.py).
"""

from __future__ import annotations

import numpy as np
import torch

from maskcli.trace.codes import ByCode
from maskcli.trace.sites import HELD
from maskcli.trace.tops import MOST

DOCUMENTS = frozenset(("cu_seqlens", "cu_seq_lens_q", "cu_seqlens_q"))  # the names that say a module was handed them


def documents(calls: list, start: int, kwargs: dict, tokens: int | None = None) -> None:
    """The calls from `start` on, made inside an inner module that was handed documents as a keyword (an encoder
    layer's `self_attn(hidden, cu_seqlens=...)`: Qwen2-VL's and Qwen3-ASR's) or in an argument object (`handed`), get
    them as details["documents"] (the innermost module's kept): the model call's arguments do not hold them, as the
    encoder builds them inside. `tokens`: how many tokens that module attends over (details["documents_over"])."""
    found = {}
    for name in ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_kv"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() == 1 and 1 < value.numel() <= MOST and not value.is_floating_point() \
                and value.device.type != "meta":
            found[name] = value.detach().cpu().numpy().astype(np.int64)
    if found:
        for call in calls[start:]:
            call.details.setdefault("documents", found)
            if tokens is not None:
                call.details.setdefault("documents_over", tokens)


PACKED = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_k", "cu_seqlens")  # a packed-sequence object's fields


_PLAIN = frozenset((type(None), bool, int, float, str, tuple, list, dict, torch.Tensor, torch.nn.Parameter))


def handed(variables: dict) -> tuple[dict, int | None] | None:
    """(the documents, the tokens it attends over) of one running module call (its _call_impl's `args` / `kwargs`):
    cu_seqlens given by keyword, or held by an argument object (Megatron's `PackedSeqParams(cu_seqlens_q=...,
    cu_seqlens_kv=...)`, handed on positionally from layer to layer); the tokens are those of its first float
    tensor argument (its hidden states: (T, H), (S, B, H) or (B, S, H) flattened, as a varlen kernel reads them).
    None where it was handed none (a dict lookup or two per argument)."""
    args, kwargs = variables.get("args") or (), variables.get("kwargs") or {}
    given = kwargs if kwargs and not DOCUMENTS.isdisjoint(kwargs) else None
    if given is None:
        for value in (*args, *kwargs.values()) if kwargs else args:
            if type(value) in _PLAIN or isinstance(value, (torch.Tensor, torch.nn.Module)):
                continue  # (most arguments: a type lookup each)
            try:  # (never the program's __getattr__ / __getattribute__: a slotted object's may raise anything)
                fields = object.__getattribute__(value, "__dict__")
            except Exception:  # noqa: BLE001 - no instance dict, or the program's own descriptor raising: none handed
                continue
            if isinstance(fields, dict) and not DOCUMENTS.isdisjoint(fields):
                given = {name: fields[name] for name in PACKED if name in fields}
                break
        else:
            return None
    hidden = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.is_floating_point()), None)
    tokens = hidden.numel() // hidden.shape[-1] if hidden is not None and hidden.dim() in (2, 3) and hidden.shape[-1] else None
    return given, tokens


_HOLDS = ByCode()  # code -> the names in HELD among its variables (matched once per code)


def held_by(walked) -> dict:
    """The cu_seqlens the innermost function of the program holds as its own variables at a call made inside a module
    (musubi-tuner's `attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_kv, ...)`, called from a block's processor): a
    dict lookup by code at most calls, its locals read only where its code names them."""
    if walked is None or not walked.held:
        return {}
    frame = walked.held[0][0]
    code = frame.f_code
    names = _HOLDS.get(code)
    if names is None:
        names = _HOLDS.put(code, tuple(name for name in HELD if name in code.co_varnames))
    if not names:
        return {}
    variables = frame.f_locals
    return {name: variables[name] for name in names if variables.get(name) is not None}
