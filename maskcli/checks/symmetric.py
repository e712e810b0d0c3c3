"""A symmetric sliding window one key short on each side of the W / 2 its config states (checks/config.py's layers).

Where a config states a sliding window and the attention both ways (EmbeddingGemma's use_bidirectional_attention, an
encoder's is_causal=False), the window is read as W keys on either side (|q - k| < W or <= W) or as W keys around the
query, |q - k| <= W / 2: transformers' Gemma3TextConfig (sliding_window // 2 + 1 with abs(q - kv) < window),
llama.cpp's LLAMA_SWA_TYPE_SYMMETRIC and Longformer's attention_window // 2 all keep that. A band |q - k| < W / 2 is
one key short of it on each side: the half-window halved or rounded down once more (llama.cpp#15867: a converter that
wrote the already-adjusted W // 2 + 1, which the runtime halved again). Said only where the mask is exactly that band
on every real query and key of every batch row, and none of the readings above.
"""

from __future__ import annotations

from maskcli.checks.config import _each_layer_call, _layer
from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def narrowed(run: Run) -> list:
    """A both-ways sliding layer whose band is |q - k| < W / 2: one key short of |q - k| <= W / 2 on either side."""
    found = []
    for call, stated, index, kind, placed in _each_layer_call(run):
        if kind is None or kind[0] != "sliding_attention" or stated.window() is None or not stated.bidirectional():
            continue
        size, name = stated.window()
        half = size // 2
        if half < 2 or half + 1 >= placed.cells.shape[-1]:
            continue  # (too short a window or sequence for the band to tell one reading from another)
        if any(placed.holds(f"band({w})") for w in (size, size + 1, half + 1)) or not placed.holds(f"band({half})"):
            continue
        source, sure = stated.said(name), name == "sliding_window"
        found.append((call, Finding("window-half-short", (
            f"{_layer(index, call)} sees |q - k| <= {half - 1}, one key short on each side of the |q - k| <= {half} "
            f"that a symmetric window of {size} keeps ({source}; both ways: {stated.said(stated.bidirectional())}): "
            f"a strict < where <= was meant, or the half-window halved once more" + ("" if sure else ", unless its window_size counts "
            "the keys on one side")), severity=None if sure else "suspicious", expected=f"band({half + 1})",
            source=source)))
    return found


RULES = (
    Rule("window-half-short", "wrong", "steps", "a sliding layer whose config states the attention both ways and whose "
         "band |q - k| < W / 2 is one key short on each side of the W / 2 a symmetric window keeps (llama.cpp#15867)",
         narrowed),
)
