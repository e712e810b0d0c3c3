"""The TorchFunctionMode of a trace: on in a thread only while a tensor it follows is alive there.

entry.py's wrappers see the few torch calls that start what the trace follows (q @ kᵀ scores, a
fill that overflowed, a softmax's weights); while one of those tensors is alive, every torch call
of that thread passes through this mode (what is computed from them is what scores.py, overflow.py
and after.py must see), and both hand each call to Trace.dispatch.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from maskcli.trace.entry import canonical

compiling = torch.compiler.is_dynamo_compiling


class Mode(TorchFunctionMode):
    """A trace's mode (module docstring): every call handed to Trace.dispatch as the function it stands for."""

    def __init__(self, trace):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if compiling():  # dynamo traces this mode into the graph it builds: add nothing to it (the scores and overflow
            # bookkeeping inlined there broke Gemma 3's rotary; guards on its sets fail), but a graph break at attention
            return self.trace.compiled.during(self, canonical(func), types, args, kwargs)
        return self.trace.dispatch(canonical(func), args, kwargs, func)


def has_values(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds values to read: not meta, nor fake, nor inside vmap or grad (functorch's wrappers)."""
    if tensor.is_meta or _wrapped(tensor):  # (is_meta: reading .device makes an object, on every attention call)
        return False
    return type(tensor).__name__ != "FakeTensor"


_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
