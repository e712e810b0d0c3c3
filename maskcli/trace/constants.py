"""The window and the layer kinds a program states as constants of its main module (`SLIDING_WINDOW = 12`,
`LAYER_TYPES = ["sliding", "full"]`), as an exported runtime's script keeps them beside a static graph.

Read at each outermost model call from `__main__`'s globals (a few dict lookups), kept on its Top as `main_window`
(name, W) and `main_layer_types` (name, tuple of str); checks/layerwindow.py reads them. Nothing else reads them: the
config rules' statements are the program's config objects (trace/stated.py).
"""

from __future__ import annotations

import sys

WINDOWS = ("SLIDING_WINDOW", "SLIDING_WINDOW_SIZE", "sliding_window")  # the keys a sliding layer's query reads back
KINDS = ("LAYER_TYPES", "layer_types", "ATTENTION_TYPES")  # each layer's attention, one word per layer


def main_constants() -> dict:
    """{"main_window": (name, W), "main_layer_types": (name, kinds)} where `__main__` holds both, else {}."""
    main = sys.modules.get("__main__")
    names = getattr(main, "__dict__", None)
    if not isinstance(names, dict):
        return {}
    window = next(((n, names[n]) for n in WINDOWS if type(names.get(n)) is int and names[n] > 0), None)
    kinds = next(((n, tuple(names[n])) for n in KINDS if isinstance(names.get(n), (list, tuple)) and names[n]
                  and all(isinstance(x, str) for x in names[n])), None)
    if window is None or kinds is None:
        return {}
    return {"main_window": window, "main_layer_types": kinds}
