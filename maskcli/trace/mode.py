"""The TorchFunctionMode of a trace: on in a thread only while a tensor it follows is alive there.

entry.py's wrappers see the few torch calls that start what the trace follows (q @ kᵀ scores, a
fill that overflowed, a softmax's weights); while one of those tensors is alive, every torch call
of that thread passes through this mode (what is computed from them is what scores.py, overflow.py
and after.py must see), and both hand each call to Trace.dispatch.
"""

from __future__ import annotations

from types import FunctionType

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from maskcli.trace.entry import canonical

compiling = torch.compiler.is_dynamo_compiling


def _building():
    """building(): whether dynamo is compiling a frame in this thread now (torch._guards' compile context, set around
    a whole compile: its tracing, the backend, its guards). Its own torch calls then (a backend's, AOT's on real tensors,
    a table dynamo fills under a mode of its own) are none of the program's: the trace lets them pass, and never pushes
    or pops its mode there. Dynamo saves the mode stack as a compile starts and checks it unchanged at its end: the mode
    pushed for a backend's q @ kᵀ failed that check ("Guard failed on the same frame it was created"), and the correct
    program with it."""
    try:
        from torch._guards import CompileContext

        current = CompileContext.try_get
    except (ImportError, AttributeError):  # (a torch without it: no compile context to read)
        return lambda: False
    return lambda: current() is not None


building = _building()


class Mode(TorchFunctionMode):
    """A trace's mode (module docstring): every call handed to Trace.dispatch as the function it stands for."""

    def __init__(self, trace):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if type(func) is FunctionType:  # (a Python function: torch's own, or a program's patch of a method)
            func = _called(func)
        if compiling():  # dynamo traces this mode into the graph it builds: add nothing to it (the scores and overflow
            # bookkeeping inlined there broke Gemma 3's rotary; guards on its sets fail), but a graph break at attention
            return self.trace.compiled.during(self, canonical(func), types, args, kwargs)
        return self.trace.dispatch(canonical(func), args, kwargs, func)


_BUILTINS = vars(torch._C.TensorBase)
_PATCHES: dict = {}  # a Python function the mode was handed -> the builtin method it replaces (itself where none)


def _called(func):
    """The function a call handed to the mode as `func` ran: a Tensor method's builtin reaches a mode as whatever
    `torch.Tensor.<name>` holds when it runs, so where the program replaced that attribute with its own wrapper
    (`Tensor.masked_fill = counting`, which calls the builtin it kept), the mode is handed that wrapper, and calling it
    would run the program's code a second time for one call of its own. The builtin runs instead, as under python
    (the wrapper that called it is already running). Looked up once per function."""
    found = _PATCHES.get(func)
    if found is None:
        found = func
        for name, value in vars(torch.Tensor).items():
            if value is func and name in _BUILTINS and name not in _TENSOR_OWN:
                found = _BUILTINS[name]
                break
        else:  # (F.softmax hands the mode whatever F's global `softmax` holds: a program's wrapper, the same way)
            for name, value in vars(F).items():
                if value is func and _FUNCTIONAL.get(name, func) is not func:
                    found = _FUNCTIONAL[name]
                    break
        if len(_PATCHES) < 4096:
            _PATCHES[func] = found
    return found


_FUNCTIONAL = {name: value for name, value in vars(F).items() if type(value) is FunctionType}  # as torch defines them
_TENSOR_OWN = frozenset(vars(torch.Tensor))  # (what torch.Tensor defines in Python itself, over the builtins: as torch
# defines it, it is no patch)


def has_values(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds values to read: not meta, nor fake, nor inside vmap or grad (functorch's wrappers)."""
    if tensor.is_meta or _wrapped(tensor):  # (is_meta: reading .device makes an object, on every attention call)
        return False
    return type(tensor).__name__ != "FakeTensor"


_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
