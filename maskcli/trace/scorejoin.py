"""Scores joined along their keys: two runs of keys under one softmax, or a sink column beside them (trace/scores.py).
"""

from __future__ import annotations

import torch


def keys_joined(scores, args: tuple, kwargs: dict, out: torch.Tensor) -> bool:
    """`out` joins scores along their keys (the last dim): the same queries' scores against two runs of keys, one
    softmax over both (a prefix-prefill kernel's cached context, then its new tokens: vLLM's context_attention_fwd).
    At most (B, H, Lq, Lk): block-local scores with a block axis more (Pegasus-X's, BigBird's: (B, H, blocks, X, G + Y),
    global keys beside each block's own) join keys that differ from block to block, no one row of key positions."""
    parts = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or out.dim() > 4 or dim not in (-1, out.dim() - 1):
        return False
    return any(isinstance(x, torch.Tensor) and scores.has(x) and id(x) not in scores.axes and x.dim() == out.dim()
               and x.shape[:-1] == out.shape[:-1] for x in parts)


def sink_joined(scores, args: tuple, kwargs: dict) -> int | None:
    """The keys of scores joined along their keys to one last column that is no scores (q @ kᵀ made none of it): a
    learned sink logit per head (openai/gpt-oss's torch reference: `torch.cat([QK, S], dim=-1)`, S the module's
    `sinks` expanded), on no key position and never masked; None where the parts are not so."""
    parts = args[0] if args else kwargs.get("tensors")
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not all(isinstance(x, torch.Tensor) for x in parts):
        return None
    first, last = parts
    if not scores.has(first) or scores.has(last) or last.shape[-1] != 1 or first.shape[-1] < 1:
        return None
    return int(first.shape[-1])
