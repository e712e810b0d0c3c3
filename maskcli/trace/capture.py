"""Recording the attention calls of a running program: a TorchFunctionMode, module hooks, and the calls' masks.

The mode sees every torch function; for the few that are attention (SDPA, MHA's
functional form, a softmax over scores) it reads the mask before calling the function
exactly as it was called, and returns its result untouched. FlexAttention runs its
operator under torch.compile even in eager mode, where a mode's Python cannot run, so
`flex_attention` is wrapped instead: in torch's module and wherever a loaded module holds
it (patch.py swaps its code); flash_attn's functions are swapped the same way, and Hugging
Face's AttentionInterface lookups return wrapped functions (interface.py), when the program
has imported them or as soon as it does. Module hooks keep the stack of modules being run,
which names where a call came from.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from maskcli import tracefile
from maskcli.text import step_label
import maskcli.trace.masks as readers
from maskcli.trace.masks import Operands
import maskcli.trace.flash as flash
import maskcli.trace.interface as interface
from maskcli.trace.flex import flex as read_flex
from maskcli.trace.patch import Watch, swap

APIS = ("sdpa", "flex", "mha", "softmax", "flash", "hf")
DEFAULT_MAX_BYTES = 256 << 20
CACHE = 256  # masks remembered by the tensor they were read from (a model hands one mask to every layer)


@dataclass
class Call(Operands):
    """One attention call: where it came from, what it computed on, and its mask (a key into Trace.masks)."""

    index: int = 0
    where: str = ""
    step: int = 0
    mask: str | None = None
    details: dict = field(default_factory=dict)
    trace: object = field(default=None, repr=False, compare=False)

    @property
    def stored(self) -> dict | None:
        return self.trace.masks.get(self.mask) if self.mask is not None else None

    def keep(self) -> np.ndarray:
        """Bool (B, H, Lq, Lk), True = may attend (a read-only broadcast view where batch rows or heads repeat)."""
        return np.broadcast_to(tracefile.dense(self.stored), self.shape)

    def json(self) -> dict:
        return {"index": self.index, "where": self.where, "api": self.api, "step": self.step,
                "step_label": self.details.get("step_name") or step_label(self.step, self.shape[2]), "shape": list(self.shape),
                "q": list(self.q), "k": list(self.k), "v": list(self.v), "dtype": self.dtype, "device": self.device,
                "mask": self.mask, "details": dict(self.details)}


def _collapse(keep: torch.Tensor) -> torch.Tensor:
    """The batch and head dimensions cut to 1 where every row of them is the same."""
    for dim in (0, 1):
        if keep.shape[dim] > 1 and bool((keep == keep.narrow(dim, 0, 1)).all()):
            keep = keep.narrow(dim, 0, 1)
    return keep


class _Mode(TorchFunctionMode):
    def __init__(self, trace: Trace):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reader = self.trace.readers.get(func)  # the hot path: one lookup per torch call
        if reader is not None and not self.trace.busy and not self.trace.within and not torch.compiler.is_dynamo_compiling():
            self.trace.capture(reader, args, kwargs)  # (inside a compiled region nothing of ours may run)
        return func(*args, **kwargs)


class Trace:
    """`with Trace() as t: ...` records every attention call in t.calls; each distinct mask is kept once in t.masks."""

    def __init__(self, apis=APIS, max_bytes: int = DEFAULT_MAX_BYTES):
        self.apis = tuple(apis)
        self.max_bytes = max_bytes
        self.calls: list[Call] = []
        self.masks: dict[str, dict] = {}
        self.bytes = 0
        self.busy = False
        self.readers = {}
        if "sdpa" in self.apis:
            self.readers[F.scaled_dot_product_attention] = readers.sdpa
        if "mha" in self.apis:
            self.readers[F.multi_head_attention_forward] = readers.mha
        if "softmax" in self.apis:
            for func in (torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax):
                self.readers[func] = readers.softmax
        self._names: dict[int, tuple[torch.nn.Module, str]] = {}
        self._stack: list[torch.nn.Module] = []
        self._opened: tuple | None = None  # the outermost module running, and the calls made before it began
        self.tops: list = []  # maskcli.checks.context.Top: each outermost module call, its config and arguments
        self._steps: Counter = Counter()
        self._cache: dict = {}
        self._handles: list = []
        self.within = 0  # inside a module recorded from its arguments (modules.py): its inner calls are not new ones
        self.mode = _Mode(self)
        self._unwrap: list = []
        self._undo: list = []  # what puts swapped functions and patched classes back, in the order done
        self._swapped: set[int] = set()
        self.interfaces: list[dict] = []  # the Hugging Face interface calls running (interface.py), innermost last
        self.patched: set[str] = set()  # "flash", "hf": the APIs whose modules the program imported (so were patched)
        self.active = False

    def groups(self) -> list:
        """The calls grouped by mask, API and shape, each named, with findings (maskcli.trace.report.Group): those
        made where a mask is named, and those of the rules that read the run (maskcli.checks)."""
        from maskcli.checks.engine import apply
        from maskcli.checks.context import Run
        from maskcli.trace.report import group

        return apply(group(self.calls), Run(self.calls, self.tops))

    def report(self) -> str:
        """The grouped report as plain text, one line per group and one per finding."""
        from maskcli.trace.report import text

        return text(self.groups(), len(self.calls))

    # --- entering and leaving -----------------------------------------------------------------

    def __enter__(self) -> Trace:
        from torch.nn.modules import module as nn_module

        self._handles = [nn_module.register_module_forward_pre_hook(self._pre),
                         nn_module.register_module_forward_hook(self._post, always_call=True, with_kwargs=True)]
        if "flex" in self.apis:
            self._patch_flex()
        from maskcli.trace.modules import wrap

        self._unwrap = wrap(self, record="mha" in self.apis)  # always: the mode must not take their fast paths away
        self._watch = Watch(self._wanted).__enter__()
        loaded = [name for name in (interface.MODULE, *flash.MODULES) if name in sys.modules]
        if "flash_attn" in loaded:  # its submodules too (not a walk of every module loaded: thousands, with transformers)
            loaded += [name for name in list(sys.modules) if name.startswith("flash_attn.")]
        for name in loaded:  # what the program imported already; the watch sees what it imports later
            found = self._wanted(name) if sys.modules.get(name) is not None else None
            if found is not None:
                found(sys.modules[name])
        self.active = True
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        from maskcli.trace.modules import unwrap

        unwrap(self._unwrap)
        self._unwrap = []
        self._watch.__exit__()
        self.active = False
        while self._undo:
            self._undo.pop()()
        self._swapped.clear()
        self._cache.clear()
        self._stack.clear()
        self._names.clear()  # the program's modules are its own again once the trace ends

    def _patch_flex(self) -> None:
        """flex_attention's own code swapped for a shim that records the call first (patch.swap)."""
        import torch.nn.attention.flex_attention as flex_module

        undo = swap(flex_module.flex_attention, lambda original: self._hook(read_flex, original))
        if undo is not None:  # (not a plain function in some torch: then its calls go unseen, as compiled ones do)
            self._undo.append(undo)

    def _wanted(self, name: str):
        """What to do once module `name` is loaded: swap flash_attn's functions, or patch HF's AttentionInterface."""
        if "flash" in self.apis and flash.watched(name):
            return self._patch_flash
        if "hf" in self.apis and name == interface.MODULE:
            return self._patch_hf
        return None

    def _patch_flash(self, module) -> None:
        import inspect
        import types

        for name in flash.FUNCTIONS:
            function = getattr(module, name, None)
            if not isinstance(function, types.FunctionType) or id(function) in self._swapped:
                continue  # (flash_attn re-exports its interface module's functions: each is swapped once)
            self.patched.add("flash")
            read = flash.reader(name, inspect.signature(function))
            undo = swap(function, lambda original, read=read: self._hook(read, original))
            if undo is not None:
                self._swapped.add(id(function))
                self._undo.append(undo)

    def _patch_hf(self, module) -> None:
        self.patched.add("hf")
        undo = interface.patch(self, module)
        self._undo.append(lambda: interface.unpatch(undo))

    def _hook(self, reader, original, inner: bool = True):
        """The function a swapped one runs: the call recorded, then the original run as called; with `inner`, the
        attention calls it makes itself (a stand-in's softmax) are its own, not new ones."""

        def hook(*args, **kwargs):
            if torch.compiler.is_dynamo_compiling() or self.busy or self.within:
                return original(*args, **kwargs)
            self.capture(reader, args, kwargs)
            self.within += inner
            try:
                return original(*args, **kwargs)
            finally:
                self.within -= inner

        return hook

    # --- where a call comes from --------------------------------------------------------------

    def _pre(self, module, args) -> None:
        if torch.compiler.is_dynamo_compiling():  # a compiled region runs without us (its calls are not recorded)
            return
        if id(module) not in self._names:
            self._name(module)
        if not self._stack:
            self._opened = (module, len(self.calls))
        self._stack.append(module)

    def _post(self, module, args, kwargs, output) -> None:
        if torch.compiler.is_dynamo_compiling():
            return
        for i in range(len(self._stack) - 1, -1, -1):  # the innermost entry of it (an exception may have left others)
            if self._stack[i] is module:
                del self._stack[i:]
                break
        opened = self._opened
        if not self._stack and opened is not None and opened[0] is module:
            self._opened = None
            if len(self.calls) > opened[1]:  # an outermost call that made attention calls: what the checks read of it
                from maskcli.trace.tops import top

                self.tops.append(top(self.where_of(module), module, args, kwargs, opened[1], len(self.calls)))

    def _name(self, module) -> None:
        """Name `module` and everything under it: by its path in the outermost module running, else as a new root."""
        for outer in self._stack:
            for name, inner in outer.named_modules():
                if inner is module:
                    base = self._names[id(outer)][1]
                    prefix = f"{base}." if base else ""
                    for sub, child in module.named_modules(prefix=prefix + name):
                        self._names.setdefault(id(child), (child, sub))
                    return
        for name, child in module.named_modules():
            self._names.setdefault(id(child), (child, name))

    def where_of(self, module) -> str:
        return self._names.get(id(module), (module, ""))[1] or type(module).__name__

    def where(self) -> str:
        if self._stack:
            module = self._stack[-1]
            name = self._names.get(id(module), (module, ""))[1]
            return name or type(module).__name__
        return _first_frame_outside()

    # --- recording ----------------------------------------------------------------------------

    def capture(self, reader, args, kwargs) -> None:
        """Record one call; whatever goes wrong here is noted on the call and never reaches the program."""
        first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
        if first is not None and not _has_values(first):
            return  # inside vmap, or shapes without values (meta, fake): no mask to read, nothing run for real
        self.busy = True
        try:
            where = self.where()
            try:
                with torch.no_grad():
                    seen = reader(args, kwargs)
                    if seen is None:
                        return
                    if self.interfaces and seen.api == "sdpa":  # HF's sdpa may have packed GQA heads as query rows
                        interface.unpack_gqa(seen, self.interfaces[-1])
                    key = self._store(seen)
            except Exception as error:  # a call maskcli cannot read is still a call: say so and carry on
                api = getattr(reader, "api", "?")
                self._append(Call(api, (0, 0, 0, 0), (), (), (), "", "", index=len(self.calls), where=where, step=self._step(where),
                                  details={"error": f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"}, trace=self))
                return
            if seen.child:
                where = f"{where}.{seen.child}" if where else seen.child
            self._append(Call(**{**seen.operands(), "shape": tuple(int(x) for x in seen.shape)}, index=len(self.calls), where=where,
                              step=self._step(where), mask=key, details=seen.details, trace=self))
        finally:
            self.busy = False

    def _append(self, call: Call) -> None:
        """A call made inside a Hugging Face interface call carries what HF told that call (and is what it did)."""
        if self.interfaces:
            call.details["hf"] = self.interfaces[-1]["hf"]
            self.interfaces[-1]["seen"] += 1
        self.calls.append(call)

    def _step(self, where: str) -> int:
        step = self._steps[where]
        self._steps[where] += 1
        return step

    def _store(self, seen) -> str:
        if seen.intervals is not None:
            stored = tracefile.from_intervals(seen.intervals, seen.shape, seen.planes)
            return self._keep(stored, seen.shape)
        cache_key = None
        if seen.sources:  # the same mask tensor given again (every layer of a model): read it once
            cache_key = (seen.api, seen.shape, tuple((id(x), x._version) for x in seen.sources))
            found = self._cache.get(cache_key)
            if found is not None:
                return found[0]
        from maskcli.trace.store import stored_form

        keep = _collapse(seen.keep)
        stored = stored_form(keep, seen.shape, self.max_bytes - self.bytes, self.max_bytes)
        key = self._keep(stored, seen.shape)
        if cache_key is not None:
            if len(self._cache) >= CACHE:
                self._cache.clear()
            self._cache[cache_key] = (key, seen.sources)  # the tensors are held so that their ids stay theirs
        return key

    def _keep(self, stored: dict, shape) -> str:
        key = tracefile.digest(stored)
        if key in self.masks:
            return key
        size = tracefile.nbytes(stored)
        if size and self.bytes + size > self.max_bytes:
            found = tracefile.counts(stored)
            factor = (shape[0] * shape[1]) // (found.shape[0] * found.shape[1])
            kept, empty = int(found.sum()) * factor, int((found == 0).sum()) * factor
            stored = tracefile.stats_only(shape, kept, empty, f"past --max-bytes {self.max_bytes}")
            key = tracefile.digest(stored)
            size = 0
        self.masks.setdefault(key, stored)
        self.bytes += size
        return key


def _has_values(tensor: torch.Tensor) -> bool:
    if tensor.device.type == "meta" or torch._C._functorch.is_functorch_wrapped_tensor(tensor):
        return False
    return type(tensor).__name__ != "FakeTensor"


def _first_frame_outside() -> str:
    """file:line of the innermost frame that is neither torch's nor maskcli's."""
    torch_dir = os.path.dirname(torch.__file__)
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith((torch_dir, own)) and not name.startswith("<frozen"):
            try:
                shown = os.path.relpath(name)
            except ValueError:
                shown = name
            return f"{shown if not shown.startswith('..') else os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"
