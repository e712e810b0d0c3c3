"""Where an attention call comes from: its call site and its step.

A call site is one module instance (or, where no module runs, the program's file:line);
its steps are the repeated calls of that site. A module is named by its path from the
outermost module holding it: the outermost module running, else the outermost module the
program's frames hold that contains it (`model.encoder(...)` called on its own, as
nn.Transformer users and the Annotated Transformer's `model.encode` do, is `encoder`, its
layers `encoder.layers.0.self_attn`, never the decoder's `layers.0.self_attn`). Two
modules that would get one name (two instances of one class, each called on its own) are
told apart: the later one by the name the program holds it by, else `Class#N`.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import threading
from collections import Counter

import torch

from maskcli.trace.builders import causal_builder
from maskcli.trace.crossing import Readings
from maskcli.checks.causalname import both_class, causal_class
from maskcli.trace.forwardflag import around, said_both_ways, stated_flag
from maskcli.trace.held import padding, split_top
from maskcli.trace.masktype import mask_type
from maskcli.trace.reqlens import lengths
from maskcli.trace.swin import shifted_windows
from maskcli.trace.walk import own_dirs as _own_dirs, walk  # noqa: F401 - (walk: capture.py's, one import line there)
from maskcli.trace.windows import look_ahead, window_held

FRAMES = 64  # frames of the program searched for a module's owner
_CAUSAL = re.compile(r"(?:^|_)causal(?:_|$)", re.IGNORECASE)
_NOT_CAUSAL = re.compile(r"non_?causal|not_causal|bidirectional", re.IGNORECASE)


@functools.lru_cache(maxsize=4096)
def _causal_name(name: str) -> bool:
    return bool(_CAUSAL.search(name)) and not _NOT_CAUSAL.search(name)


def causal_function(codes: tuple) -> str | None:
    """`name()` of the innermost program function attending where its name says causal (`causal_attention`, mlxcel's
    `causal_attention` behind its decode steps), else None."""
    return f"{codes[0].co_name}()" if codes and _causal_name(codes[0].co_name) else None


class Sites:
    """Module names, the stack of modules running (one per thread), and each call site's count of calls."""

    def __init__(self):
        self._local = threading.local()
        self._names: dict[int, tuple[torch.nn.Module, str]] = {}  # id -> (module, path): the module held, so its id stays
        self._taken: dict[str, int] = {}  # shown name -> id of the module that has it
        self._steps, self.stepped = Counter(), None  # (each site's count; the site last counted: trace/rescored.py)
        self.readings = Readings()  # each call site's cross-attention reading, read at its first call (trace/crossing.py)
        self.walked = None  # the frames of the call being recorded, walked once for every reader (trace/walk.py)

    @property
    def stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @property
    def held(self) -> dict:
        """The documents the function that made the last call outside any module holds (frames_outside's `held`)."""
        return getattr(self._local, "held", None) or {}

    def enter(self, module) -> None:
        if id(module) not in self._names:
            self._name(module)
        self.stack.append(module)

    def load(self, modules, walked=None, frames=None) -> list:
        """The stack of this thread as `modules` (outermost first: the module calls running, read from the frames at an
        attention call), each named where it is not yet; the stack. `walked`: the call's frames (walk.py), for note().
        `frames`: each module's call frame, beside `modules` (where a module is not held by one running around it, its
        holder is looked for from the frame that called it outward: the frames inside its own call hold none)."""
        self.walked = walked
        stack, names = self.stack, self._names
        stack.clear()
        for i, module in enumerate(modules):
            if id(module) not in names:
                self._name(module, None if frames is None else frames[i].f_back)
            stack.append(module)
        return stack

    def unload(self) -> None:
        """The call recorded: this thread's stack emptied, its frames let go."""
        self.stack.clear()
        self.walked = None

    def leave(self, module) -> None:
        stack = self.stack
        if stack and stack[-1] is module:  # (every module call: the common case first)
            stack.pop()
            return
        for i in range(len(stack) - 1, -1, -1):  # the innermost entry of it (an exception may have left others)
            if stack[i] is module:
                del stack[i:]
                break

    def clear(self) -> None:
        self.stack.clear()
        self._names.clear()  # the program's modules are its own again once the trace ends
        self._taken.clear()
        self.readings.clear()

    def note(self, details: dict, caller, shape: tuple) -> None:
        """What a call's details say of where it was made: the running module's own word that it is causal
        (checks/own.py), the line that called the function attending (checks/steps.py's causal-lost), whether its
        keys are another sequence's (trace/crossing.py; `shape`: the call's (B, H, Lq, Lk))."""
        walked = self.walked
        flag = guarded(causal_flag, self.stack) or (None if walked is None else guarded(stated_flag, self.stack, walked.held))
        if flag is not None:
            details["module_causal" if not flag.endswith("=False") else "module_not_causal"] = flag.removesuffix("=False")
            if flag.endswith("=False") and self.walked is not None:  # (a model whose forward is handed causal per call
                # around a module that says False: GritLM's; checks/directions.py leaves those calls alone)
                if (said := around(self.stack, self.walked.held)) is not None:
                    details["forward_causal"] = said
        if caller is not None:
            details["caller"] = caller
        if "cross" not in details:  # (a reader may have said it already: one query's scores, trace/masks.py)
            line = None if walked is None else walked.line_within if self.stack else walked.line
            reading = guarded(self.readings.of, self.stack, shape, line)  # keys another sequence's? (checks/context.crossing)
            if reading is not None:
                details["cross"] = reading
        held = None if walked is None else walked.held
        attending = None if walked is None else (walked.line_within if self.stack else walked.line)[0]
        for key, reader, *arguments in (
                ("function_causal", causal_function if walked is not None else None, attending),  # (checks/causal_lm.py)
                ("class_causal", causal_class, self.stack),  # the attending module's class named causal: the same weak word
                ("class_both", both_class, self.stack),  # a transformers model the program subclassed, named bidirectional
                ("decoder_builder", causal_builder, self.stack),  # a decoder whose code builds causal masks (checks/directions.py)
                ("forward_not_causal", said_both_ways if walked is not None else None, self.stack, held, details),
                ("shifted_windows", shifted_windows, self.stack),  # a Swin block's shifted windows and its mask (checks/swin.py)
                ("held_padding", padding, held),  # the padding the program's frames hold (checks/held.py)
                ("look_ahead", look_ahead if walked is not None else None, self.stack, walked and walked.windows),
                ("request_lengths", lengths if held is not None else None, held),  # an engine's per-request lengths (reqlens.py)
                # a window the attending module holds (and a plain int one beside its query's position)
                ("window_handed", window_held, self.stack, _own_dirs(), details, None if walked is None else walked.windows)):
            value = None if reader is None else guarded(reader, *arguments)
            if value is not None:
                details[key] = value
        split_top(details)  # (a script's top-level padding apart: held.py)

    def current(self, child: str | None = None) -> tuple[tuple, str]:
        """(site key, where) of a call made now; `child`: the submodule of the running one that attends."""
        stack = self.stack
        if not stack:  # a function's line, with the line that called it (checks/steps.py's causal-lost reads both)
            held = self._local.held = {}  # (the attending function's documents: capture.py hands them to documents())
            where, caller = frames_outside(2, held)
            return ("line", where, caller), where
        module = stack[-1]
        inner = getattr(module, child, None) if child else None
        if isinstance(inner, torch.nn.Module):
            if id(inner) not in self._names:
                self._name(inner)
            module = inner
        where = self.shown(module)
        if child and inner is None:
            where = f"{where}.{child}"
        return ("module", id(module), child if inner is None else None), where

    def shown(self, module) -> str:
        return self._names.get(id(module), (module, ""))[1] or type(module).__name__

    def path(self, module) -> str | None:
        """The prefix of the `where` of the calls made in `module` ("" for an outermost module named by itself); None
        where it is not named."""
        found = self._names.get(id(module))
        return None if found is None else found[1]

    def step(self, key: tuple) -> int:
        step, self.stepped = self._steps[key], key
        self._steps[key] += 1
        return step

    # --- naming -------------------------------------------------------------------------------

    def _name(self, module, caller=None) -> None:
        """Name `module` and everything under it by its path in the outermost module that holds it. `caller`: the frame
        that called it, where known (the program's frames are searched for a holder from there outward)."""
        owner = None
        for outer in self.stack:  # a running module that holds it
            path = _path(outer, module)
            if path is not None:
                owner = (outer, path)
                break
        if owner is None:
            owner = _owner(module, caller)  # else one the program's frames hold
        if owner is None:
            self._root(module)
            return
        outer, path = owner
        if id(outer) not in self._names:
            self._root(outer)
        base = self._names[id(outer)][1]
        self._tree(module, f"{base}.{path}" if base else path)

    def _root(self, root) -> None:
        """A module no other one holds: named from itself, with a prefix where one of its names is taken already."""
        tree = list(root.named_modules())  # (walked once: _tree names them from it where no prefix is needed)
        names = [(child, sub) for sub, child in tree if id(child) not in self._names]
        if any(self._taken.get(sub or type(child).__name__, id(child)) != id(child) for child, sub in names):
            label = _variable(root)
            if label is None or label in self._taken:
                count = 2
                while f"{type(root).__name__}#{count}" in self._taken:
                    count += 1
                label = f"{type(root).__name__}#{count}"
            self._tree(root, label)
        else:
            self._tree(root, "", tree)

    def _tree(self, module, prefix: str, tree: list | None = None) -> None:
        """`module` and everything under it named by their paths under `prefix` (`tree`: its named_modules(), walked
        already, where the prefix is "")."""
        wrapped = type(module).__name__ == "OptimizedModule"  # torch.compile's: the program's module is its _orig_mod
        for sub, child in tree if tree is not None else module.named_modules(prefix=prefix):
            if wrapped:
                sub = ".".join(part for part in sub.split(".") if part != "_orig_mod")
            if id(child) not in self._names:
                self._names[id(child)] = (child, sub)
                self._taken.setdefault(sub or type(child).__name__, id(child))


def running(frame, calls: list | None = None) -> list[tuple]:
    """(module, frame, its variables) of each module call running in `frame` and those that called it, innermost first:
    nn.Module's _call_impl frames (one per call, hooks or not; dynamo keeps those of the code it compiled around a graph
    break). Read at an attention call instead of hooks on every module call of the program. `calls`: the frames among
    them that are module calls (_call_impl's or a `__call__`), where the call's stack was walked already (walk.py)."""
    found, call, start = [], _CALL, frame
    for frame in (_outwards(frame) if calls is None else calls):
        code = frame.f_code
        if code is call or code.co_name == "_call_impl":
            variables = frame.f_locals
            module = variables.get("self")
            if issubclass(type(module), torch.nn.Module):
                found.append((module, frame, variables))
        elif code.co_name == "__call__":
            own = _own_call(frame)
            if own is not None and not (found and found[-1][0] is own[0]):  # (a `__call__` that calls super().__call__:
                found.append(own)  # its _call_impl frame, inside it, is the module's call already)
    return found or _handed(start)


def _handed(frame) -> list[tuple]:
    """Where no module's call runs: (module, frame, its variables as _call_impl's) of each frame whose first argument
    is a module, innermost first, each module once (its innermost frame): a module's method called as one (a model's
    `prefill(self, ids)`), or a function handed a layer as `self` (unsloth's fast decode forwards), so that their
    attention has the layer's path and the model's call its arguments and config, as a module call's would."""
    found, seen = [], set()
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and not code.co_filename.startswith(_OWN):
            module = frame.f_locals.get(code.co_varnames[0])
            if issubclass(type(module), torch.nn.Module) and id(module) not in seen:
                seen.add(id(module))
                variables = frame.f_locals
                names = code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount]
                found.append((module, frame, {"self": module, "args": (),
                                              "kwargs": {n: variables[n] for n in names if n in variables}}))
        frame = frame.f_back
    return found


_OWN = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))  # (torch's and maskcli's frames)


def _outwards(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def _own_call(frame) -> tuple | None:
    """(module, frame, variables as _call_impl's) of a module whose class defines its own `__call__` (ports from MLX
    and Flax NNX write `def __call__(self, x, mask=None)`, so no _call_impl frame runs for them): its arguments by
    name, as the keywords a call of it was given. None where the frame is no such module's call."""
    module = frame.f_locals.get("self")
    if not issubclass(type(module), torch.nn.Module) or getattr(type(module).__call__, "__code__", None) is not frame.f_code:
        return None
    code = frame.f_code
    variables = frame.f_locals
    names = code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount]
    return module, frame, {"self": module, "args": (), "kwargs": {n: variables[n] for n in names if n in variables}}


_CALL = torch.nn.Module._call_impl.__code__


def _path(outer, module) -> str | None:
    for name, inner in outer.named_modules():
        if inner is module:  # (torch.compile's wrapper holds the program's module as _orig_mod: not the program's name)
            return ".".join(p for p in name.split(".") if p != "_orig_mod") if type(outer).__name__ == "OptimizedModule" else name
    return None


def guarded(reader, *args):
    """reader(*args), or None where the program's frames hold what it cannot read (an object whose every attribute
    raises): one reader's detail left out, the call read all the same."""
    try:
        return reader(*args)
    except (Exception, SystemExit):  # noqa: BLE001 - the program's objects are not maskcli's to fail on
        return None


def _modules_in_frames(start=None):
    """The nn.Modules the program's frames hold in their variables (innermost first, from `start` where given), once."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    frame, seen, searched = sys._getframe(1) if start is None else start, set(), 0
    while frame is not None and searched < FRAMES:
        if not frame.f_code.co_filename.startswith(skip):  # torch's and maskcli's own frames hold none of the program's
            searched += 1
            for name, value in list(frame.f_locals.items()):
                if issubclass(type(value), torch.nn.Module) and id(value) not in seen:
                    if name != "self":  # (a forward's own module, read at a call inside it: named by its caller's variable)
                        seen.add(id(value))
                    yield name, value
        frame = frame.f_back


def _owner(module, start=None) -> tuple[torch.nn.Module, str] | None:
    """(holder, path) of the outermost module in the program's frames (from `start` outward, where given) that holds
    `module` (a compiled module's wrapper left out: its `_orig_mod` is torch.compile's, not the program's)."""
    best, tried = None, set()
    for _, candidate in _modules_in_frames(start):
        if candidate is module or id(candidate) in tried or type(candidate).__name__ == "OptimizedModule":
            continue
        tried.add(id(candidate))  # (a model is `self` in many of its frames: its modules walked once)
        path = _path(candidate, module)
        if path and (best is None or path.count(".") > best[1].count(".")):
            best = (candidate, path)
    return best


def _variable(module) -> str | None:
    """The name of the innermost variable of the program that holds `module` (how the program calls it)."""
    for name, value in _modules_in_frames():
        if value is module and name.isidentifier() and name != "self":
            return name
    return None


HELD = ("cu_seqlens", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_kv", "cu_seq_lens_q", "cu_seq_lens_k")


def frames_outside(count: int, held: dict | None = None) -> list[str]:
    """file:line of the `count` innermost frames that are neither torch's nor maskcli's ("?" past the outermost).
    `held`: filled with the innermost such frame's local variables named in HELD (the documents a plain attention
    function was given as cu_seqlens: its variable names are looked at first, so most frames cost no locals read)."""
    skip = _own_dirs()
    frame, found, here = sys._getframe(1), [], None
    while frame is not None and len(found) < count:
        name = frame.f_code.co_filename
        if name == _RUNNER:  # (maskcli's frame that runs the program: what called it is maskcli's CLI, not the program)
            break
        if not name.startswith(skip):
            here = os.getcwd() if here is None else here
            found.append(f"{_shown(name, here)}:{frame.f_lineno}")
            if held is not None and len(found) == 1 and not set(HELD).isdisjoint(frame.f_code.co_varnames):
                variables = frame.f_locals
                held.update((n, variables[n]) for n in HELD if variables.get(n) is not None)
        frame = frame.f_back
    return found + ["?"] * (count - len(found))


_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py")  # (trace/run.py: runs the program)


@functools.lru_cache(maxsize=1024)
def _shown(name: str, here: str) -> str:
    """A frame's file as a call's `where` shows it: relative to the working directory `here`, else its base name."""
    try:
        shown = os.path.relpath(name, here)
    except ValueError:
        shown = name
    return shown if not shown.startswith("..") else os.path.basename(name)


def causal_flag(stack: list) -> str | None:
    """'Class.causal' where the innermost running module's own (or its class's) `is_causal` / `causal` is True,
    'Class.causal=False' where False (an encoder's layer beside a decoder's: checks/dropped.py); else its causal mask
    type ('Class.attn_mask_type=causal': trace/masktype.py); else 'Class.is_decoder=False' (an encoder's attention:
    checks/directions.py); None otherwise (dict lookups: nn.Module's __getattr__ raises for a missing one)."""
    if not stack:
        return None
    module = stack[-1]
    for name in ("is_causal", "causal"):
        value = vars(module).get(name, getattr(type(module), name, None))
        if isinstance(value, bool):
            return f"{type(module).__name__}.{name}" + ("" if value else "=False")
    decoder = vars(module).get("is_decoder", getattr(type(module), "is_decoder", None))
    return mask_type(module) or (f"{type(module).__name__}.is_decoder=False" if decoder is False else None)
