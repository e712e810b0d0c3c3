"""An exp of scores that a softmax then runs over: a transform of the scores, not a softmax written by hand.

trace/masks.py reads `exp(q @ kᵀ ...)` as the numerator of a softmax written by hand (ONNX's reference
`exp(x - max(x)) / sum`), recorded as a call when the exp runs (nothing after it is known yet). Some programs exp their
scores and then mask and softmax them: SAHP's attention computes `exp(q @ kᵀ) / sqrt(d)`, fills it with -1e9 where its
mask is 0, and takes `F.softmax` of that. That exp is no attention: the softmax after it is, and the exp's call, read
over scores no mask had reached yet, says the mask was dropped on its way and that padding keys are seen.

So the output of each exp recorded as a softmax is followed (by identity, a weak reference: nothing kept alive)
through what keeps its last two dimensions (a scaling, a fill, a mask added or multiplied in) but a division by a
tensor (its row's sum: the normalisation that makes it a softmax). A softmax recorded over one of those withdraws the
exp's call where it is still the last call recorded (its index, its model call's first call: the softmax takes them),
and lets go of what the trace followed of it (its weights: no `over_weights` of a call that is gone). An exp divided
by its row's sum and then softmaxed again is a softmax over weights (checks/weighted.py), not followed here.
"""

from __future__ import annotations

import torch

from maskcli.trace.followed import follow

DIVS = frozenset({torch.div, torch.Tensor.div, torch.Tensor.div_, torch.Tensor.__truediv__, torch.Tensor.__itruediv__,
                  torch.true_divide, torch.Tensor.true_divide, torch.divide, torch.Tensor.divide})


class Rescored:
    """The outputs of exps recorded as softmaxes, and what is computed of them, by identity: id -> (ref, call)."""

    def __init__(self):
        self._found: dict[int, tuple] = {}

    def note(self, out, call, seen) -> None:
        """At exp `call` (read as `seen`) whose output is `out`: follow `out`."""
        if seen.details.get("by_hand") == "exp" and isinstance(out, torch.Tensor):
            follow(self._found, id(out), out, call)

    def entry(self, x):
        if not self._found or not isinstance(x, torch.Tensor):
            return None
        found = self._found.get(id(x))
        return found if found is not None and found[0]() is x else None

    def after(self, func, args: tuple, kwargs: dict, out) -> None:
        """What a call computed of a followed exp output: followed in turn where it keeps its last two dimensions and
        is no division by a tensor (a row's sum: then it is weights)."""
        if not self._found or not isinstance(out, torch.Tensor) or out.dim() < 2:
            return
        for position, x in enumerate((*args, *kwargs.values())):
            found = self.entry(x)
            if found is None:
                continue
            if tuple(out.shape[-2:]) != tuple(x.shape[-2:]):
                return
            if func in DIVS and (position > 0 or len(args) < 2 or isinstance(args[1], torch.Tensor)
                                 and args[1].numel() > 1):
                return  # (normalised by a tensor: a softmax by hand, its weights)
            follow(self._found, id(out), out, found[1])
            return

    def withdraw(self, trace, given) -> None:
        """A softmax is about to be recorded over `given`: where it came from an exp recorded as a softmax that is
        still the trace's last call, that call is withdrawn (no attention: the softmax is)."""
        found = self.entry(given)
        calls = trace._calls
        if found is None or not calls or calls[-1] is not found[1]:
            return
        call, steps, site = calls.pop(), trace.sites._steps, trace.sites.stepped
        if site is not None and steps[site] == call.step + 1:  # (its step counted at its site: given back)
            steps[site] -= 1
        trace._fixed = min(trace._fixed, len(calls))
        trace._late[:] = [late for late in trace._late if late is not call]
        for table in (self._found, trace.weights._found, trace.after._found):
            for key in [key for key, entry in table.items() if len(entry) > 1 and entry[1] is call]:
                del table[key]
