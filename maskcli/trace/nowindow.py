"""A window the attending module states as None, and the map it was handed: the tokens it attends per image.

A windowed attention module holds its window as an attribute (`self.window_size`, `self.win_size`, ...), and None
there says it has none (a None window is no window: one window over the whole map, as lucidrains' ScalableViT means
its IWSA's `window_size=None`). At each call, the innermost running modules (INNERMOST of them, innermost first) are
read for such an attribute; where the innermost one that holds one holds None, the call records
details["no_window"] = {"said": "self.window_size=None of X", "input": the shape of the first tensor argument X's
forward was handed (its map (B, C, H, W) or (B, H, W, C), its tokens (B, N, D))}, read off the module call's own frame
(walk.py's `calls`). checks/nowindow.py compares it with the call's rows. Read once per stack of modules (their ids),
and the frame only where a module states a None window.
"""

from __future__ import annotations

import torch

WINDOWS = ("window_size", "win_size", "window", "window_len", "window_length", "attn_window_size", "local_window_size")
INNERMOST = 3  # the attention module, a kernel module inside it (nn.Softmax), the block around it
_READ: dict = {}  # (ids of the innermost modules) -> (those modules, (module, name) of a None window, or None)


def note(details: dict, stack: list, shape, walked) -> None:
    """details["no_window"] where the innermost running module that states a window states None (see above)."""
    if not stack or shape is None or walked is None:
        return
    inner = stack[-INNERMOST:]
    key = tuple(map(id, inner))
    held = _READ.get(key)  # (its modules held there: no id of a key is another object's while it is kept)
    if held is None:
        if len(_READ) > 4096:
            _READ.clear()
        held = _READ[key] = (tuple(inner), _none_window(inner))
    if held[1] is None:
        return
    module, name = held[1]
    if vars(module).get(name, 0) is not None:  # (set since it was read)
        return
    first = _first_input(module, walked)
    if first is not None:
        details["no_window"] = {"said": f"self.{name}=None of {type(module).__name__}", "input": first}


def _none_window(inner: list):
    """(module, name) of the innermost module among `inner` stating a window, where it states None; None otherwise."""
    for module in reversed(inner):
        own = vars(module)
        name = next((n for n in WINDOWS if n in own), None)
        if name is not None:
            return (module, name) if own[name] is None else None
    return None


def _first_input(module, walked) -> tuple | None:
    """The shape of the first tensor argument the running call of `module` was handed (3 to 5 axes); None otherwise."""
    for frame in walked.calls:
        variables = frame.f_locals
        if variables.get("self") is not module:
            continue
        args = variables.get("args")
        first = args[0] if isinstance(args, tuple) and args else None
        if issubclass(type(first), torch.Tensor) and 3 <= first.dim() <= 5:
            return tuple(int(n) for n in first.shape)
        return None
    return None
