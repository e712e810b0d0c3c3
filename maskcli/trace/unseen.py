"""Where maskcli reads the program's tensors with no __torch_function__: where one is of the program's own subclass.

A subclass's __torch_function__ (or the program's own mode) must see only the program's calls, as under python (it
may count or log them); plain tensors have none to hide from, and entering torch's guard costs more than most calls
(about a microsecond), so it is entered only where such a tensor is among a call's arguments or its result.
"""

from __future__ import annotations

import torch

_Disable = torch._C.DisableTorchFunction
_tracing, _set_tracing = torch._C._get_tracing_state, torch._C._set_tracing_state
_Tensor = torch.Tensor


class unseen:
    """No __torch_function__ while maskcli reads, and torch.jit's tracer paused where the program traces (torch.jit.trace,
    the TorchScript ONNX exporter): maskcli's reads are no ops of the graph the program records."""

    __slots__ = ("_guard", "_state")

    def __enter__(self):
        self._guard = _Disable()
        self._guard.__enter__()
        self._state = _tracing()
        if self._state is not None:
            _set_tracing(None)
        return self

    def __exit__(self, *exc):
        if self._state is not None:
            _set_tracing(self._state)
        return self._guard.__exit__(*exc)


def plain(args: tuple, kwargs: dict, out=None) -> bool:
    """No tensor of a subclass among `args`, `kwargs` and `out` (read them as they are), and no torch.jit trace being
    recorded; else enter unseen()."""
    if type(out) is not _Tensor and isinstance(out, _Tensor) or _tracing() is not None:
        return False
    for value in args:
        if type(value) is not _Tensor and isinstance(value, _Tensor):
            return False
    if kwargs:
        for value in kwargs.values():
            if type(value) is not _Tensor and isinstance(value, _Tensor):
                return False
    return True
