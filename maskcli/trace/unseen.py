"""Where maskcli reads the program's tensors with no __torch_function__: where one is of the program's own subclass.

A subclass's __torch_function__ (or the program's own mode) must see only the program's calls, as under python (it
may count or log them); plain tensors have none to hide from, and entering torch's guard costs more than most calls
(about a microsecond), so it is entered only where such a tensor is among a call's arguments or its result.
"""

from __future__ import annotations

import torch

unseen = torch._C.DisableTorchFunction
_Tensor = torch.Tensor


def plain(args: tuple, kwargs: dict, out=None) -> bool:
    """No tensor of a subclass among `args`, `kwargs` and `out` (read them as they are); else enter unseen()."""
    if type(out) is not _Tensor and isinstance(out, _Tensor):
        return False
    for value in args:
        if type(value) is not _Tensor and isinstance(value, _Tensor):
            return False
    if kwargs:
        for value in kwargs.values():
            if type(value) is not _Tensor and isinstance(value, _Tensor):
                return False
    return True
