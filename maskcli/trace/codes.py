"""What a frame walker found of a code object, kept by the object's id.

A code object is no cheap dict key: CPython hashes its name, bytecode, constants and names anew at every lookup (a
microsecond or more for a model's forward), and the frame walkers at an attention call (held.py, windows.py,
crossing.py) look up every frame of the stack. Keyed by id(code) with the code held beside the value, so that its id
stays its own.
"""

from __future__ import annotations


class ByCode:
    """code object -> value, looked up by id (a dict keyed by the code object itself hashes it at every lookup)."""

    __slots__ = ("found",)

    def __init__(self):
        self.found: dict[int, tuple] = {}  # id(code) -> (code, value)

    def get(self, code):
        held = self.found.get(id(code))
        return held[1] if held is not None and held[0] is code else None

    def put(self, code, value):
        self.found[id(code)] = (code, value)
        return value

    def clear(self) -> None:
        self.found.clear()


def named_parameters(walked, names: ByCode, pattern):
    """(frame, code, name, value) of each parameter whose name `pattern` matches, in the program frames trace/walk.py
    walked (`walked.held`), innermost first; the matching names found once per code object, kept in `names`."""
    for frame, _ in walked.held:
        code = frame.f_code
        found = names.get(code)
        if found is None:
            arguments = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
            found = names.put(code, tuple(name for name in arguments if pattern.search(name)))
        for name in found:
            yield frame, code, name, frame.f_locals.get(name)
