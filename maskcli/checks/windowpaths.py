"""A config's `sliding_window_size` counted two ways by two paths of one program: the wider path is one key off.

`sliding_window_size` = W is W keys per query, the query included (LitGPT, Keras-hub, MaxText's dense path), or W + 1
(SGLang: the W keys before the query): checks/config.py's window() takes either from one call alone. Where two call
sites of one program read the same config (the same variable and class, the same fields) as a sliding layer and one
keeps exactly W keys while the other keeps W + 1 (neither causal: a short prefill is both), the program has settled
the count itself, and the wider path is an off-by-one against it (AI-Hypercomputer/maxtext#4289: Splash's LocalMask
given `sliding_window_size` as its inclusive left window, one key more than `apply_attention_dot` keeps). Read per
call over its placed rows (checks/config.py's placing: padding and cache offsets resolved); said by config.py's
window-off-by-one rule, whose check calls this.
"""

from __future__ import annotations

import re
from typing import Callable

from maskcli.text import Finding

_HOLDER = re.compile(r"\((\S+ \([^()]*\))")  # "config (Config)" of "sliding_window_size=4 (config (Config) in f() of x.py)"


def counted_both_ways(layer_calls: list, named: Callable) -> list:
    """(call, window-off-by-one) for each call keeping W + 1 keys of a `sliding_window_size` W that another call site
    reading the same config keeps as exactly W. `layer_calls`: config.py's (call, intent, layer, kind, placed) of a
    run; `named`: its name of a layer (config.py's `_layer`)."""
    paths: dict = {}
    for call, stated, index, kind, placed in layer_calls:
        if kind is None or kind[0] != "sliding_attention" or stated.window() is None or stated.bidirectional():
            continue
        size, name = stated.window()  # (W + 1: the wider reading)
        if name != "sliding_window_size" or size < 3 or placed.holds("causal"):
            continue
        wide, narrow = placed.holds(f"window({size})"), placed.holds(f"window({size - 1})")
        if wide == narrow:
            continue
        said = stated.said(name)
        holder = _HOLDER.search(said)
        same = (repr(sorted(stated.values.items())), holder.group(1) if holder else said)
        paths.setdefault(same, []).append((call, index, wide, said, size - 1))
    found = []
    for each in paths.values():
        narrow = next((one for one in each if not one[2]), None)
        if narrow is None:
            continue
        for call, index, wide, said, size in each:
            if wide and call.where != narrow[0].where:
                found.append((call, Finding("window-off-by-one", (
                    f"{named(index, call)} sees window({size + 1}), one key wider than its config's {said}, which "
                    f"the program's other path ({named(narrow[1], narrow[0])}) keeps as window({size}) from the same "
                    f"config: the window counted with the query once more (an inclusive left bound given W, not W - 1)"),
                    expected=f"window({size})", source=f"{said}; window({size}) at {narrow[0].where}")))
    return found
