"""A mask the attending code names causal and holds as None where the kernel is called (`causal_mask = None`).

transformers' SDPA paths (4.36 .. 4.47: `LlamaSdpaAttention`, and every port of them) leave `causal_mask` None where the
batch has no padding, so that the kernel's own `is_causal` flag adds the triangle: the name is the program's word that
the layer is causal, the None its word that the kernel is to make it so. Read from the program's frames trace/walk.py
walked, from the kernel's caller out to the innermost running module's own forward (a helper it calls included): the
first local named like a causal mask (`causal_mask`, `causal_attention_mask`; not `non_causal_mask`) that holds None is
recorded as details `causal_none` ("name in function() of file"), for checks/causalnone.py. Nothing is recorded where
those frames, the module or its config say the attention is not causal (a `causal` / `is_causal` flag that is False:
`causal_mask = None` under `if not self.causal` is a choice, not a word), or where a running module is named an encoder
or a vision tower.
"""

from __future__ import annotations

import functools
import os
import re

from maskcli.checks.causalname import _NOT
from maskcli.checks.configread import read

_NAME = re.compile(r"causal\w*mask", re.IGNORECASE)
_FLAGS = ("causal", "is_causal", "use_causal", "use_causal_mask", "decoder")
_ENCODERS = re.compile(r"Encoder|Vision|ViT|Bert", re.IGNORECASE)
_CODES: dict = {}  # code -> (names like a causal mask, causal flags) among its locals


def _names(code) -> tuple:
    """(its locals named like a causal mask, its locals named as a causal flag) of `code`, matched once."""
    found = _CODES.get(code)
    if found is None:
        found = _CODES[code] = (tuple(n for n in code.co_varnames if _NAME.search(n) and not _NOT.search(n)),
                                tuple(n for n in _FLAGS if n in code.co_varnames))
    return found


@functools.lru_cache(maxsize=1024)
def _encoder(name: str) -> bool:
    return bool(_ENCODERS.search(name))


def _says_not(owner) -> bool:
    """The module, or its config, holds a causal flag that is False (read as configread reads a config: never the
    program's own __getattr__, which python would not have run)."""
    for holder in (owner, read(owner, "config")):
        if holder is None:
            continue
        for flag in _FLAGS[:4]:
            if read(holder, flag) is False:
                return True
    return False


def note(details: dict, stack: list, walked) -> None:
    """details["causal_none"] = "name in function() of file" where the attending code holds a causal mask of None."""
    if not stack or walked is None:
        return
    module = stack[-1]
    forward = getattr(getattr(type(module), "forward", None), "__code__", None)
    found = None
    for frame, _ in walked.held:
        code = frame.f_code
        names, flags = _names(code)
        if names or flags:
            local = frame.f_locals
            if any(local.get(flag) is False for flag in flags):
                return  # (a frame handed or holding causal=False: the None is its choice)
            if found is None:
                name = next((name for name in names if name in local and local[name] is None), None)
                found = None if name is None else f"{name} in {code.co_name}() of {os.path.basename(code.co_filename)}"
        if code is forward and frame.f_locals.get("self") is module:
            break
    else:
        return  # (the module's own forward not among the frames: a kernel called from elsewhere)
    if found is not None and not any(_encoder(type(m).__name__) for m in stack) and not _says_not(module):
        details["causal_none"] = found  # (the module's and its config's words read only where a None was found)
