"""Each layer's own word on whether it slides: a module's bool `is_sliding` (or KerasHub's
`use_sliding_window_attention`), else its own `sliding_window` (an int > 0:
it slides; None: it does not), read for the calls at or under it (the innermost module's word: checks/intent.py).

transformers' Gemma 2 attention keeps `self.sliding_window = config.sliding_window if not bool(layer_idx % 2) else
None` and its decoder layer `self.is_sliding` (beside a `sliding_window` every layer holds); a Qwen2 written by hand
keeps `self.sliding_window` set only on the layers its own reading of `max_window_layers` makes sliding. That is the
program's statement of the layer's kind where its config states only `sliding_window` (which every layer may then
share) or Qwen2's `max_window_layers` in a config that is not transformers' (whose direction the program's own code
decides); Intent.kind reads it only where a config states the window, and never over layer_types.
"""

from __future__ import annotations

FLAGS = ("is_sliding", "use_sliding_window_attention")  # (KerasHub's Gemma 2 / 3 attention holds the second, per layer:
# `sliding_window = use_sliding_window_attention and (i % 6 < 5)` in its backbone)
WINDOW = "sliding_window"


def own_windows(root, path) -> list:
    """Stated({"layer_slides": bool}) per module that states its own kind, for the calls at or under it."""
    from maskcli.checks.intent import Stated

    found = []
    for module in root.modules():
        scope, own = path(module), vars(module)
        if scope is None:
            continue
        flag = next((name for name in FLAGS if type(own.get(name)) is bool), None)
        if flag is not None:
            value, name = own[flag], flag
        elif WINDOW in own and (own[WINDOW] is None or type(own[WINDOW]) is int):
            value, name = own[WINDOW] is not None and own[WINDOW] > 0, WINDOW
        else:
            continue
        found.append(Stated(f"self.{name}={own[name]} of {scope or type(module).__name__}", scope, {"layer_slides": value}))
    return found
