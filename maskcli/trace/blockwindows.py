"""The windows the running modules state as plain ints: a local attention's block size, as its model was configured.

A local attention that reshapes its sequence into blocks of a window (snac's `LocalMHA`: `T // window_size` blocks of
`window_size` frames, then SDPA over each) runs with the window its module holds (`self.window_size`); the model that
built it states the window it was configured with as an attribute of its own (snac's `SNAC.attn_window_size`) or of a
config it keeps (`self.config.window_size`, `self.cfg.local_window`). Recorded per call, outermost first, as
details["block_windows"]: [(W, "self.attn_window_size of SNAC"), ...], only where two statements on the stack differ
(checks/blockwindow.py compares them with the blocks the kernel ran). A sliding window (`sliding_window*`) and a pair
(Swin's (h, w)) are left out: trace/windows.py reads those. Read once per stack of modules (their ids).
"""

from __future__ import annotations

import re

from maskcli.checks.intent import NAMES as CONFIGS  # (the names a module keeps its config under)

WINDOW = re.compile(r"^(?!sliding)(?:[a-z]+_)*window(?:_size|_len|_length)?$")  # attn_window_size, local_window, window
_READ: dict = {}  # (ids of the stack's modules) -> (the modules, what they state)


def note(details: dict, stack: list) -> None:
    """details["block_windows"] where the running modules `stack` (outermost first) state two windows that differ."""
    if not stack:
        return
    key = tuple(map(id, stack))
    held = _READ.get(key)
    if held is None or any(a is not b for a, b in zip(held[0], stack)):
        if len(_READ) > 4096:
            _READ.clear()
        held = _READ[key] = (tuple(stack), _stated(stack))
    if held[1]:
        details["block_windows"] = held[1]


def _stated(stack: list) -> list:
    """[(W, where)] each module's plain int windows and those of the configs it keeps, outermost first; [] where they
    all agree."""
    found = []
    for module in stack:
        own = vars(module)
        found += [(value, f"self.{name} of {type(module).__name__}") for name, value in own.items()
                  if type(value) is int and value > 0 and WINDOW.match(name)]
        for holder in CONFIGS:
            config = own.get(holder)
            fields = config if isinstance(config, dict) else getattr(config, "__dict__", None)
            if isinstance(fields, dict):
                found += [(value, f"self.{holder}.{name} of {type(module).__name__}") for name, value in fields.items()
                          if isinstance(name, str) and type(value) is int and value > 0 and WINDOW.match(name)]
    return found if len({value for value, _ in found}) > 1 else []
