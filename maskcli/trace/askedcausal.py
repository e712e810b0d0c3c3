"""A module's forward handed a word that asks for causality per call (`self_attention(x, x, x, mask="subsequent")`).

maxjcohen/transformer's MultiHeadAttention (and ports of it) take a string, not a tensor: `mask="subsequent"` on the
decoder's self-attention adds the future mask, `mask=None` on the encoder's and the cross-attention's adds none. Read
from the innermost running module's own forward frame (among the program's frames trace/walk.py walked, as
forwardflag.py reads `use_causal_mask=True`): each parameter named like a mask or causal flag that the caller handed a
string, or None, is recorded as details `forward_word` (the class, the parameter, the string or None), for
checks/askedcausal.py to compare the calls that asked with those that did not. Only strings are words: a bool is a
hint torch's own modules and Keras's ports may pass beside a causal mask of their own, a tensor is cells.
"""

from __future__ import annotations

import maskcli.trace.biasnone as biasnone
import maskcli.trace.cachebranch as cachebranch
import maskcli.trace.causalnone as causalnone
from maskcli.trace.forwardflag import forward_frame

NAMES = ("mask", "causal")  # words of a parameter that may carry the word


def note(details: dict, stack: list, walked) -> None:
    """details["forward_word"] = (class, parameter, string or None) of the innermost running module, where one of its
    forward's parameters named like NAMES was handed a string (or None, in a forward that takes such a string);
    also the causal mask the same frames hold as None (trace/causalnone.py), and the causal triangle its forward builds
    in its branch for no cache where this call was handed one (trace/cachebranch.py)."""
    if not stack or walked is None:
        return
    causalnone.note(details, stack, walked)
    cachebranch.note(details, stack, walked)  # (a causal triangle in the forward's branch for no cache)
    biasnone.note(details, stack, walked)  # (a position bias parameter that holds None: checks/biasdropped.py)
    module = stack[-1]
    if type(module).__module__.startswith("torch."):
        return  # (torch's own modules take tensors and bool hints)
    found = forward_frame(stack, walked.held, lambda code: any(w in n for n in code.co_varnames for w in NAMES))
    if found is None:
        return
    frame, arguments = found
    for name in arguments:
        if any(word in name for word in NAMES):
            value = frame.f_locals.get(name)
            if value is None or isinstance(value, str) and len(value) < 64:
                details["forward_word"] = (type(module).__name__, name, value)
                return
