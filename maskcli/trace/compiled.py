"""The torch.compile'd code a traced program runs: counted and named, and the attention inside it recorded.

Compiled code runs the graph dynamo made, where neither maskcli's mode nor its module hooks
run. Dynamo inlines the mode's __torch_function__ into the graph it builds; there, for SDPA and
MHA, the mode calls a torch._dynamo.disable'd recorder (Compiled.during): a graph break, so the
call runs eagerly each time the compiled code runs, and is recorded with the modules its frames
run in. Under fullgraph=True (or error_on_graph_break) a break would be the program's error: the
call stays in the graph, unseen, and the note says so. Each call of compiled code enters it
through torch._dynamo.eval_frame's compile_wrapper (a compiled function's, and an
OptimizedModule's forward), which installs dynamo's frame callback with
eval_frame._maybe_set_eval_frame(callback) and restores the prior one (None outside compiled
code) when it returns (torch/_dynamo/eval_frame.py, compile_wrapper, lines 1077-1224 of
torch 2.13). So while tracing that module attribute is wrapped: a compile_wrapper frame's
first call of it enters compiled code (one run, named by the compiled module's class or the
function's name), its second leaves it. With TORCHDYNAMO_DISABLE=1 in the environment
torch.compile returns the function unchanged (torch._dynamo.config.disable), the code runs
eagerly and every call in it is traced.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter

import torch
import torch.nn.functional as F

SWITCH = "TORCHDYNAMO_DISABLE=1"
_SDPA = torch._C._nn.scaled_dot_product_attention  # (F's attribute is entry.py's wrapper while tracing)


MODULE = "torch._dynamo.eval_frame"  # patched once the program has imported it (torch.compile does)


class Compiled:
    """Once patched, .runs counts each compiled function's calls (by name), and .eager(mode, func, ...) is the call
    of an attention function that dynamo meets while it compiles code under the trace: a graph break (the function is
    torch._dynamo.disable'd), so the call runs eagerly each time the compiled code runs, and the mode records it."""

    def __init__(self, skip=lambda: False, trace=None):
        self.skip = skip  # True while the compiled code running is a recorded call's own (flex_attention's operator)
        # code dynamo must run as Python, never compile: the trace's mode handler and module hooks
        self.python = () if trace is None else (type(trace.mode_for_compile).__torch_function__.__code__, *_codes(trace))
        self.breaks = trace is not None and bool({"sdpa", "mha"} & set(trace.apis))  # a compiled graph breaks at SDPA
        # and MHA while tracing (not at a softmax: every softmax of a compiled model would break it, and which is
        # attention is read off eager matmuls)
        self.runs: Counter = Counter()
        self.seen = 0  # attention calls recorded inside compiled code (at a graph break, or a backend in Python)
        self.whole = 0  # attention calls dynamo compiled into a graph it may not break (fullgraph=True): not recorded
        self.eager = None  # set by patch(): (mode, func, types, args, kwargs) -> the call run eagerly, recorded
        self.may_break = None  # set by patch(): () -> whether the graph dynamo is building may break (not fullgraph)
        self.made = False
        self._local = threading.local()

    def during(self, mode, func, types, args, kwargs):
        """The mode's call of `func` as dynamo traces it (inlined into the graph it builds): nothing added to the graph,
        but for SDPA and MHA a graph break where one is allowed, their call run eagerly, recorded (identity checks
        only: dynamo folds them)."""
        if (func is _SDPA or func is F.multi_head_attention_forward) and self.breaks \
                and self.eager is not None and self.may_break():
            return self.eager(mode, func, types, args, kwargs)
        return func(*args, **kwargs)

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
            if not self.made:  # (here, as compiled code is entered: torch._dynamo is whole, and dynamo not tracing)
                self.made = True
                self.eager, self.may_break = _breaks(self)
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
        seen = (f"{self.seen} attention call{'s' if self.seen != 1 else ''} inside it recorded, each a graph break "
                "while tracing" if self.seen else "")
        if not self.whole and self.seen:
            return [f"{total} call{'s' if total != 1 else ''} of torch.compile'd code ran ({named}): {seen}"]
        unseen = ("attention compiled with fullgraph=True (where no graph break is allowed) is not recorded"
                  if self.whole else "attention inside it is not recorded")
        said = "; ".join(part for part in (seen, unseen) if part)
        return [f"{total} call{'s' if total != 1 else ''} of torch.compile'd code ran ({named}): {said}; run with "
                f"{SWITCH} in the environment to run it eagerly and trace every call with its module"]


def _breaks(compiled: Compiled):
    """(eager, may_break) for Compiled: made as compiled code is first entered (torch._dynamo imported), not while
    dynamo traces.

    eager is torch._dynamo.disable'd: where the mode's __torch_function__, inlined by dynamo into the graph it builds,
    calls it for an attention function, dynamo breaks the graph there and calls it at run time with the real tensors
    (the mode is off the stack inside its own handler, so `func` runs once). may_break is run by dynamo while it
    traces (assume_constant_result): False under fullgraph=True or error_on_graph_break, where a break would be the
    program's error; those calls stay inside the graph, counted."""
    import torch._dynamo

    # The mode's handler and the module hooks are inlined where dynamo traces a program's frame; called on their own
    # (by a frame dynamo gave up on and runs eagerly, by a module call between compiled frames) they must run as
    # Python, not be compiled as frames of their own: the handler's graph break there left nanoGPT's eager frame a
    # torch.device for idx.size(), and the hooks compiled did nothing (no module path). What they call is skipped too:
    # maskcli's recording is never compiled
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # (a torch without per-code strategies: no graph break is made, the calls stay unseen)
        return None, None
    for code in compiled.python:
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))

    @torch._dynamo.disable
    def eager(mode, func, types, args, kwargs):  # (the modules running: read from the frames dynamo keeps, as eager)
        return mode.__torch_function__(func, types, args, kwargs)

    @torch._dynamo.assume_constant_result
    def may_break() -> bool:
        try:
            from torch._dynamo.symbolic_convert import InstructionTranslator

            tx = InstructionTranslator.current_tx()
        except Exception:  # noqa: BLE001 - a torch whose tracer is not this: no break, the call stays unseen
            return False
        allowed = not (getattr(tx, "one_graph", True) or getattr(tx, "error_on_graph_break", True))
        if not allowed:
            compiled.whole += 1
        return allowed

    return eager, may_break

def _name(fn) -> str:
    """A compiled module by its class (its call is Module._wrapped_call_impl, bound to it), a function by its name."""
    owner = getattr(fn, "__self__", None)
    if owner is not None and hasattr(owner, "named_modules"):
        return type(owner).__name__
    return (getattr(fn, "__qualname__", None) or type(fn).__name__).replace(".<locals>", "")


def _codes(trace) -> tuple:
    """The code of the trace's wrappers (entry.py) and of its outermost modules' hooks."""
    from maskcli.trace.entry import codes

    return (*codes(), type(trace)._outer_pre.__code__, type(trace)._outer_post.__code__)
