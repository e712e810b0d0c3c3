"""A symmetric sliding window one key short on each side of the W / 2 its config states (checks/config.py's layers).

Where a config states a sliding window and the attention both ways (EmbeddingGemma's use_bidirectional_attention, an
encoder's is_causal=False), the window is read as W keys on either side (|q - k| < W or <= W) or as W keys around the
query, |q - k| <= W / 2: transformers' Gemma3TextConfig (sliding_window // 2 + 1 with abs(q - kv) < window),
llama.cpp's LLAMA_SWA_TYPE_SYMMETRIC and Longformer's attention_window // 2 all keep that. A band |q - k| < W / 2 is
one key short of it on each side: the half-window halved or rounded down once more (llama.cpp#15867: a converter that
wrote the already-adjusted W // 2 + 1, which the runtime halved again). Said only where the mask is exactly that band
on every real query and key of every batch row, and none of the readings above.

The other way off (window-lopsided): a both-ways sliding layer whose real queries, where the window cuts on both
sides, see b keys behind and a ahead with a != b (both > 0, the same pair at every such query). No reading of a
window both ways is lopsided; a causal window OR-ed with a band made that way is (transformers#40700: EmbeddingGemma's
sliding mask_mod `kv > q - W` OR `|q - kv| <= W // 2` saw W - 1 keys back and W // 2 ahead). Read per batch row and
head on the real queries and keys only (config.py's placing); quiet where a (left, right) window pair is stated
(`sliding_windows`: a streaming encoder's look-ahead is meant shorter), where the reaches differ between queries, and on
a one-sided window (window-half-missing's).
"""

from __future__ import annotations

import numpy as np

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


def _reaches(placed) -> set:
    """{(keys behind, keys ahead)} of every real query whose seen real keys are one run cut on both sides."""
    seen = placed.seen & placed.judged  # (B, H, Lq, Lk): real keys each real query sees
    real = np.broadcast_to(placed.judged.any(axis=2, keepdims=True), seen.shape)  # the row's real keys
    found = set()
    for b, h, q in zip(*np.nonzero(seen.any(axis=-1))):
        keys = np.flatnonzero(seen[b, h, q])
        others = np.flatnonzero(real[b, h, q])
        first, last, at = int(keys[0]), int(keys[-1]), int(placed.own[q])
        if last - first + 1 != keys.size or not others[0] < first or not others[-1] > last or not first <= at <= last:
            continue  # (a query whose window does not cut on both sides, or seen in pieces)
        found.add((at - first, last - at))
    return found


def lopsided(run: Run) -> list:
    """A both-ways sliding layer whose real queries see b keys behind and a != b ahead, wherever both sides cut."""
    found = []
    for call, stated, index, kind, placed in _each_layer_call(run):
        if kind is None or kind[0] != "sliding_attention" or stated.window() is None or not stated.bidirectional() \
                or stated.get("sliding_windows") is not None:
            continue
        reaches = _reaches(placed)
        if len(reaches) != 1:
            continue
        (behind, ahead), = reaches
        if behind == ahead or not behind or not ahead:
            continue
        size, name = stated.window()
        found.append((call, Finding("window-lopsided", (
            f"{_layer(index, call)} sees {behind} keys behind each query and {ahead} ahead, where its config states a "
            f"sliding window ({stated.said(name)}) both ways ({stated.said(stated.bidirectional())}): a symmetric "
            f"window keeps as many keys on either side (a causal window OR-ed with a band?)"),
            expected=f"band({min(behind, ahead) + 1}) or band({max(behind, ahead) + 1})", source=stated.said(name))))
    return found


RULES = (
    Rule("window-half-short", "wrong", "steps", "a sliding layer whose config states the attention both ways and whose "
         "band |q - k| < W / 2 is one key short on each side of the W / 2 a symmetric window keeps (llama.cpp#15867)",
         narrowed),
    Rule("window-lopsided", "wrong", "steps", "a sliding layer whose config states the attention both ways and whose "
         "real queries see more keys on one side than the other (transformers#40700: a causal window OR-ed with a "
         "band)", lopsided),
)
