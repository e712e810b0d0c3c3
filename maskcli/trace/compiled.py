"""The torch.compile'd code a traced program runs: counted and named, since the attention inside it is not seen.

Compiled code runs the graph dynamo made, where neither maskcli's mode nor its module hooks
run: a nanoGPT sampled through torch.compile makes its attention calls unseen. Each call of
compiled code enters it through torch._dynamo.eval_frame's compile_wrapper (a compiled
function's, and an OptimizedModule's forward), which installs dynamo's frame callback with
eval_frame._maybe_set_eval_frame(callback) and restores the prior one (None outside compiled
code) when it returns (torch/_dynamo/eval_frame.py, compile_wrapper, lines 1077-1224 of
torch 2.13). So while tracing that module attribute is wrapped: a compile_wrapper frame's
first call of it enters compiled code (one run, named by the compiled module's class or the
function's name), its second leaves it. A backend that runs its graph in Python (dynamo's
"eager") makes torch calls the mode sees, but without the module hooks: those are counted. With
TORCHDYNAMO_DISABLE=1 in the environment torch.compile returns the function unchanged
(torch._dynamo.config.disable), the code runs eagerly and every call in it is traced.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter

SWITCH = "TORCHDYNAMO_DISABLE=1"


MODULE = "torch._dynamo.eval_frame"  # patched once the program has imported it (torch.compile does)


class Compiled:
    """Once patched, .runs counts each compiled function's calls (by name)."""

    def __init__(self, skip=lambda: False):
        self.skip = skip  # True while the compiled code running is a recorded call's own (flex_attention's operator)
        self.runs: Counter = Counter()
        self.seen = 0  # attention calls recorded inside compiled code (a backend that runs its graph in Python)
        self._local = threading.local()

    def inside(self) -> bool:
        """Compiled code is running in this thread now."""
        return bool(getattr(self._local, "frames", None))

    def patch(self, eval_frame):
        """Wrap eval_frame._maybe_set_eval_frame; the callable that puts it back (None where torch has no such function)."""
        original = getattr(eval_frame, "_maybe_set_eval_frame", None)
        if not callable(original):
            return None
        runs, local, skip = self.runs, self._local, self.skip

        def _maybe_set_eval_frame(callback, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_name == "compile_wrapper":  # its first call enters compiled code, its second leaves it
                frames = local.__dict__.setdefault("frames", set())
                if id(caller) in frames:
                    frames.discard(id(caller))
                elif callback is not None and callback is not False and not skip():
                    frames.add(id(caller))
                    runs[_name(caller.f_locals.get("fn"))] += 1
            return original(callback, *args, **kwargs)

        eval_frame._maybe_set_eval_frame = _maybe_set_eval_frame
        return lambda: setattr(eval_frame, "_maybe_set_eval_frame", original)

    def notes(self) -> list[str]:
        """One line where compiled code ran: how often, what, and how to see inside it."""
        if not self.runs:
            return []
        total = sum(self.runs.values())
        named = ", ".join(f"{name} ×{count}" for name, count in self.runs.most_common(6))
        seen = (f"{self.seen} attention call{'s' if self.seen != 1 else ''} inside it seen only as its backend ran "
                "them in Python, without their module paths" if self.seen else "attention inside it is not recorded")
        return [f"{total} call{'s' if total != 1 else ''} of torch.compile'd code ran ({named}): {seen}; run with "
                f"{SWITCH} in the environment to run it eagerly and trace every call with its module"]

def _name(fn) -> str:
    """A compiled module by its class (its call is Module._wrapped_call_impl, bound to it), a function by its name."""
    owner = getattr(fn, "__self__", None)
    if owner is not None and hasattr(owner, "named_modules"):
        return type(owner).__name__
    return (getattr(fn, "__qualname__", None) or type(fn).__name__).replace(".<locals>", "")
