"""What an outermost model call was handed, as shapes and words: what a new batch states of its own length.

A model handed the same things twice (a forecaster handed two batches of series of one context length, a decoder
handed two prompts of one length, with the same options) runs its first attention pass over them alike, unless state
left over from the first batch changes how it reads the second (checks/restarted.py). Kept per argument: a tensor's
shape (nothing of its values), a short word for anything else that may change what the model runs (a number's or a
flag's value, a function's name, a list's items as the same words, an object's type), so that two calls differing in
any of them (a reference attention function handed in, a list of prompts of other lengths) are not the same call.
"""

from __future__ import annotations

import torch

MOST_ITEMS = 16  # arguments (and items of a list) described: a call handed more is told apart by these


def _word(value, depth: int = 0):
    """A tensor's shape (a tuple of ints); else a short word for the value."""
    if issubclass(type(value), torch.Tensor):
        return tuple(int(n) for n in value.shape)
    if value is None or isinstance(value, (bool, int, float)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, str):
        return f"str:{hash(value)}"
    if isinstance(value, (list, tuple)) and depth < 2:
        return f"{type(value).__name__}:{tuple(_word(v, depth + 1) for v in value[:MOST_ITEMS])}:{len(value)}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"callable:{value.__qualname__}"
    return f"object:{type(value).__qualname__}"


def handed_shapes(given: dict) -> tuple:
    """((name, a tensor's shape or a word), ...) of a call's arguments (Top.shapes); () where it was handed no tensor
    of two axes or more (nothing that states a length)."""
    found = tuple((name, _word(value)) for name, value in list(given.items())[:MOST_ITEMS])
    return found if any(isinstance(w, tuple) and len(w) >= 2 for _, w in found) else ()
