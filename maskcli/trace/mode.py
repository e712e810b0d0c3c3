"""The TorchFunctionMode of a trace: every torch call of the traced program passes through it.

The few calls it looks at (attention, a matmul, a sum or a cast), and any while a tensor it follows is alive
(scores.py and overflow.py follow what is computed from the scores and from a fill that overflowed), take the slow
path; the rest cost one set lookup and two dict truth tests, as near an empty mode as Python allows.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

import maskcli.trace.masks as readers
from maskcli.trace.overflow import WATCHED

compiling = torch.compiler.is_dynamo_compiling


class Mode(TorchFunctionMode):
    """A trace's mode (module docstring): the trace's readers called on its attention calls, its watches on the rest."""

    def __init__(self, trace):
        super().__init__()
        self.trace = trace
        self.watched = trace.watched
        self.sums = WATCHED  # (the casts and sums: Overflows.wanted's, read here without a call)
        self.followed = (trace.overflows._found, trace.scores._found if trace.scores is not None else {}, trace.after._found)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if compiling():  # dynamo traces this mode into the graph it builds: add nothing to it (the scores and overflow
            # bookkeeping inlined there broke Gemma 3's rotary; guards on its sets fail), but a graph break at attention
            return self.trace.compiled.during(self, func, types, args, kwargs)
        if func not in self.watched and not self.followed[0] and not self.followed[1] and not self.followed[2]:
            return func(*args, **kwargs)  # the hot path
        trace = self.trace
        reader = trace.readers.get(func)
        softmaxed = None
        if reader is not None and trace.active and not trace.busy and not trace.within:
            if reader is not readers.softmax or trace.scores.attention(readers.softmax_input(args, kwargs)):
                trace._softmax = None
                trace.capture(reader, args, kwargs)
                softmaxed, trace._softmax = trace._softmax, None
        out = func(*args, **kwargs)
        if softmaxed is not None:  # its weights followed: a 0/1 mask multiplied in afterwards is its mask (after.py)
            trace.after.note(out, *softmaxed)
        elif self.followed[2] and trace.active and not trace.busy:
            trace.after.after(trace, func, args)
        if (func in self.sums or self.followed[0]) and isinstance(out, torch.Tensor) and out.dim() >= 2 \
                and out.is_floating_point() and trace.active and not trace.busy and has_values(out):
            trace.overflows.after(func, args, kwargs, out, trace.scores)  # (fills that overflow to -inf: overflow.py)
        if trace.scores is not None:
            trace.scores.after(func, args, kwargs, out)
        return out


def has_values(tensor: torch.Tensor) -> bool:
    if tensor.device.type == "meta" or torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        return False
    return type(tensor).__name__ != "FakeTensor"

