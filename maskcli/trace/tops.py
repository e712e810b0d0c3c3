"""The outermost module calls of a traced program (a model's forward, once per generate step), kept for the checks.

Each keeps the module's `config` (a Hugging Face model's, or any module's attribute of that name), the arguments
that say where tokens are, as small numpy arrays, and the range of attention calls it made
(maskcli.checks.context.Top). Nothing the program computes changes: the arguments are read, never held.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np
import torch

from maskcli.checks.context import Top

ARGUMENTS = ("attention_mask", "position_ids", "cache_position", "input_pos", "token_type_ids", "mm_token_type_ids",
             "cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "seq_idx")
MOST = 1 << 20  # elements of one argument kept (a batch's 2-D ids; never a 4-D mask)


@functools.cache
def _signature(cls) -> inspect.Signature | None:
    try:
        return inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return None


def top(where: str, module, args: tuple, kwargs: dict, first: int, end: int, stated: tuple = ()) -> Top:
    """The Top of one outermost call: its config and the position arguments it was given (positional ones by name)."""
    given = dict(kwargs)
    signature = _signature(type(module))
    if signature is not None and args:
        names = [name for name in signature.parameters if name != "self"]
        given.update({name: value for name, value in zip(names, args) if name not in given})
    found = {}
    for name in ARGUMENTS:
        value = given.get(name)
        if isinstance(value, torch.Tensor) and value.dim() <= 2 and value.numel() <= MOST and value.device.type != "meta" \
                and (value.dtype == torch.bool or not value.is_floating_point()):
            found[name] = value.detach().cpu().numpy().astype(np.int64)
    cache = given.get("cache", given.get("past_key_values"))  # (transformers 5.24's keyword; the older name)
    if cache is not None:
        found["past_key_values"] = type(cache).__name__
        held = _held(cache)
        if held is not None:
            found["cache_length"] = held
        sizes = _static_sizes(cache)
        if sizes:
            found["cache_slots"] = sizes
    return Top(where, getattr(module, "config", None), found, first, end, stated)


def _held(cache) -> int | None:
    """The tokens a Hugging Face cache holds once the call wrote its own (a static cache's written slots): transformers
    5.24 passes no cache_position, and its generate hands a static cache's model call a 4-D mask over every slot
    (cache_utils.py StaticLayer.get_seq_length, 502: cumulative_length, the positions written)."""
    length = getattr(cache, "get_seq_length", None)
    if not callable(length):
        return None
    try:
        held = int(length())
    except Exception:  # (a cache of the program's own whose method wants arguments: nothing read, nothing changed)
        return None
    return held if held >= 0 else None


def _static_sizes(cache) -> tuple[int, ...]:
    """The slot counts of a Hugging Face cache's static layers, each of which hands attention its whole buffer, slot j
    holding position j until it fills (cache_utils.py StaticLayer.update 462-492, get_mask_sizes 496-500;
    StaticSlidingWindowLayer keeps min(window, max_cache_len) slots, 539-541, and returns them all while not full,
    600-613). Read off `max_cache_len` of the layers that have one as an int (the static ones); () for any other."""
    layers = getattr(cache, "self_attention_cache", cache)  # (an encoder-decoder's: its decoder's own keys)
    found = {getattr(layer, "max_cache_len", None) for layer in getattr(layers, "layers", None) or ()}
    return tuple(sorted(size for size in found if isinstance(size, int) and size > 0))
