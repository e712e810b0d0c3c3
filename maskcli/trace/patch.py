"""Seeing calls of plain Python functions while tracing: their code swapped for a shim, and modules imported later.

A function's own code object is swapped for a shim that calls a hook kept in the
function's module: every name bound to the function (a module's `from x import f`, an
attribute, a local variable, a registry's value) reaches the hook, where rebinding names
would miss the copies. `inspect.signature` of the function still gives its own parameters
while swapped (Hugging Face reads flash_attn's signatures to choose what to pass), and
undoing puts the code back. The functions of a library the program imports only after the
trace began are found by an import hook that runs a callback once such a module is executed.
"""

from __future__ import annotations

import inspect
import sys
import types
import weakref
from typing import Callable

HOOK = "_maskcli_trace_hook"


def _shim(*args, **kwargs):
    """The code a swapped function runs: its co_names are replaced by the hook's global name, one per function."""
    return _maskcli_trace_hook(*args, **kwargs)  # noqa: F821 (a global of the swapped function's module while tracing)


def swapped(function) -> bool:
    code = function.__code__
    return code.co_code == _shim.__code__.co_code and len(code.co_names) == 1 and code.co_names[0].startswith(HOOK)


def swap(function, make_hook: Callable) -> Callable[[], None] | None:
    """Every call of `function` runs make_hook(original)(*args, **kwargs), `original` a copy of the function as it was;
    the callable that undoes it, or None where the function cannot be swapped (a closure, not a plain function).
    A function already swapped (a trace inside a trace) gets the new hook until the undo puts the previous one back."""
    if not isinstance(function, types.FunctionType):
        return None
    names = function.__globals__
    if swapped(function):
        name = function.__code__.co_names[0]
        previous = names.get(name)
        original = names.get(name + "_original")
        if original is None:
            return None
        names[name] = make_hook(original)
        return lambda: names.__setitem__(name, previous)
    if function.__closure__:
        return None
    name = f"{HOOK}_{id(function)}"
    original = types.FunctionType(function.__code__, names, function.__name__, function.__defaults__, function.__closure__)
    original.__kwdefaults__ = function.__kwdefaults__
    had_signature, had_wrapped = "__signature__" in function.__dict__, "__wrapped__" in function.__dict__
    if not had_signature:
        function.__signature__ = _signature(function, original)
    if not had_wrapped:  # (inspect.getsourcelines unwraps it: TorchScript, compiling a scripted function's callee such as
        function.__wrapped__ = original  # F.softmax, reads the original's source, not the shim's)
    code = function.__code__
    names[name], names[name + "_original"] = make_hook(original), original
    names_of = {"co_name": code.co_name} | ({"co_qualname": code.co_qualname} if hasattr(code, "co_qualname") else {})  # (3.11+)
    function.__code__ = _shim.__code__.replace(co_names=(name,), **names_of)  # tracebacks still name the function

    def undo() -> None:
        function.__code__ = code
        names.pop(name, None)
        names.pop(name + "_original", None)
        if not had_signature:
            function.__dict__.pop("__signature__", None)
        if not had_wrapped:
            function.__dict__.pop("__wrapped__", None)

    return undo


_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # function -> (what it was read from, signature)


def _signature(function, original) -> inspect.Signature:
    """inspect.signature of the function as it is (its code, defaults and annotations), read once: every trace swaps
    the same functions (flex_attention, MHA's functional form), and reading a long signature takes a tenth of a ms."""
    made_of = (function.__code__, function.__defaults__, function.__kwdefaults__, function.__annotations__)
    held = _SIGNATURES.get(function)
    if held is not None and all(a is b for a, b in zip(held[0], made_of)):
        return held[1]
    found = inspect.signature(original)
    try:
        _SIGNATURES[function] = (made_of, found)
    except TypeError:
        pass
    return found


class Watch:
    """A finder on sys.meta_path: after a module that `wanted(name)` gives a callback for is executed, the callback
    runs on it (a program that imports a library once the trace has begun). Whatever the callback raises is dropped:
    the import is the program's own."""

    def __init__(self, wanted: Callable[[str], Callable | None]):
        self.wanted = wanted

    def __enter__(self) -> Watch:
        sys.meta_path.insert(0, self)
        return self

    def __exit__(self, *exc) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, name, path=None, target=None):
        callback = self.wanted(name)
        if callback is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            try:
                run(module)
            finally:
                loader.__dict__.pop("exec_module", None)  # the loader is its own again (a reload runs its class's method)
            try:
                callback(module)
            except Exception:  # noqa: BLE001 - seeing the library's calls is maskcli's business, not the program's
                pass

        loader.exec_module = exec_module
        return spec
