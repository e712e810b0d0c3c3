"""The attention module's own class name as the program's word that the layer is causal (checks/causal_lm.py).

A class the program named `CausalSelfAttention` / `CausalAttention` / `causal_attention` states what its function
would state if named so (trace/sites.py's `causal_function`): the layer attends causally. It is a weak word, read
only where the same site's later steps decode over its cache (one query, or a few, over more keys), so that a
prompt pass attending both ways contradicts it. A `NonCausal...` or `Bidirectional...` class says the opposite and
is not read; neither is a class on the stack above the attending one (a `CausalVAE`'s spatial attention is no
causal layer: its causal word is about its convolutions). trace/sites.py records it at each call (`class_causal`);
checks/across.py reads `named` the other way: a cross-attention class named causal too (Perceiver AR's
`CausalCrossAttention`) states its triangle.

`both_class`: the other word, where a program states it by subclassing: its own subclass of a transformers model named
bidirectional (`LlamaBidirectionalModel`, NV-Embed's `BidirectionalMistralModel`, LLM2Vec's `LlamaBiModel`) says the
model's attention sees both ways (checks/bidirname.py).
"""

from __future__ import annotations

import functools
import re

_CAMEL = re.compile(r"Causal(?=[A-Z0-9_]|$)")  # `CausalSelfAttention`, `GPTCausalAttention`
_SNAKE = re.compile(r"(?:^|_)causal(?:_|$)", re.IGNORECASE)  # `causal_attention` as a class name
_NOT = re.compile(r"non_?causal|not_?causal|bidirectional|acausal", re.IGNORECASE)


@functools.lru_cache(maxsize=1024)
def named(name: str) -> bool:
    """The class name (or a text ending in one) says causal."""
    return bool(_CAMEL.search(name) or _SNAKE.search(name)) and not _NOT.search(name)


def causal_class(stack: list) -> str | None:
    """The innermost running module's class name where it says causal, else None (one cached lookup a call)."""
    if not stack:
        return None
    name = type(stack[-1]).__name__
    return name if named(name) else None


@functools.lru_cache(maxsize=256)
def _both_named(cls: type) -> bool:
    """A class the program wrote (not transformers' or torch's), named bidirectional, over a transformers model."""
    name = cls.__name__
    if not ("bidirectional" in name.lower() or name.endswith("BiModel")) \
            or cls.__module__.split(".")[0] in ("transformers", "torch"):
        return False
    return any(base.__name__ == "PreTrainedModel" and base.__module__.startswith("transformers.") for base in cls.__mro__)


def both_class(stack: list) -> str | None:
    """The outermost running module's class name where the program named its transformers model bidirectional."""
    return next((type(module).__name__ for module in stack if _both_named(type(module))), None)
