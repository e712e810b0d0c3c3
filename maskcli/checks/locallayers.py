"""A layer the program's config names local (GPT-Neo's `attention_layers` / `attention_types`) that sees past its window.

GPT-Neo states each layer's attention as a word, "global" or "local" (`attention_layers`, or `attention_types`
[[pattern, repeats], ...], which GPTNeoConfig expands into it), and how many keys a local layer reads, `window_size`
(its query's own key counted: modeling_gpt_neo.py keeps k > q - window_size). trace/layerkinds.py records that
statement where a config the program's frames, its running modules or its main module keep states it, with the call's
layer (an int `layer_idx` / `layer_id` / `layer_index` of its frames, else the number of its module path where a
running module keeps the config). A real
query of a local layer (padding resolved per batch row: checks/real.py) that sees more than window_size + 1 keys (one
of slack: a port that counts the keys before the query) reads keys older than any window of that size: wrong
(NVIDIA/TensorRT-Model-Connect 78c8085f1: the GPT-Neo plugin gave every layer the plain causal mask, "our causal
mask handles it", so its local layers read the whole cache). Counting keys needs no positions: it holds in any
layout of the columns (a static cache's slots before the new tokens, a left-padded batch, a cache behind the
queries).

Quiet on global layers, on a layer past the stated kinds, where no layer number is known, on padding queries (a
padding row that sees every key: transformers' sdpa un-masking), and wherever each real query sees at most
window_size + 1 keys. Only GPT-Neo's words are read here; the `sliding_window` family of configs is config.py's.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep, layer
from maskcli.checks.real import by_row, resolve
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def local_layers(run: Run) -> list:
    """The first call of each local layer (per call site) whose real query sees more keys than its window holds."""
    found, done = [], set()
    unmasked = {id(call) for call in run.unmasked}
    for call in sorted((*run.calls, *run.unmasked), key=lambda c: c.index):
        said = call.details.get("layer_kinds")
        if not said or call.stored is None and id(call) not in unmasked:
            continue
        index = said.get("layer")
        if index is None and said.get("held") == "module":
            index = layer(call)  # (a module path's number speaks only under the module that keeps the config)
        kinds, size, most = said["kinds"], int(said["window"]), int(said["keys"])
        if index is None or not 0 <= index < len(kinds) or kinds[index] != "local" or (call.where, index) in done:
            continue
        if call.shape[3] <= most:
            continue  # (no more keys than a window holds: nothing to see past it)
        hit = (0, 0, call.shape[3], 0) if id(call) in unmasked else _past(call, run, most)
        if hit is None:
            continue
        done.add((call.where, index))
        b, q, seen, oldest = hit
        field = said["field"] + (f"[{index}] = 'local'" if said["field"] == "attention_layers" else
                                 f" (layer {index}: 'local')" if said["field"] != "global_attn_indexes" else
                                 f" (layer {index} not among them)")
        where = said.get("layer_said") or f"its module path {call.where}"
        found.append((call, Finding("local-layer-unwindowed", (
            f"layer {index} ({where}) is a local layer by its config ({said['source']}: {field}, window_size="
            f"{size}), so a query reads at most {said['said']}; but batch row {b}'s query {q} sees {seen} keys (the "
            f"first of them key {oldest}): the local layer attends as the global layers do (its window never applied)"),
            expected=f"at most {most} keys a query on the local layers", source=f"{said['field']}, window_size of "
            f"{said['source']}", cell=(b, q, oldest))))
    return found


def _past(call, run: Run, most: int) -> tuple[int, int, int, int] | None:
    """(batch row, query row, keys it sees, the first key it sees) of the first real query of `call` that sees
    more than `most` keys; None where none does."""
    cells = keep(call)
    if cells is None:
        return None
    rows = by_row(cells)
    seen = rows.sum(-1)  # (b, Lq): the keys each query sees, over the heads
    over = seen > most
    if not over.any():
        return None
    real = resolve(call, run.top(call), rows, own_cells=True).queries
    if real.shape != over.shape:
        return None
    over &= real
    if not over.any():
        return None
    b, q = (int(x) for x in np.argwhere(over)[0])
    return b, q, int(seen[b, q]), int(np.flatnonzero(rows[b, q])[0])


RULES = (
    Rule("local-layer-unwindowed", "wrong", "call", "a layer its config names local (GPT-Neo's attention_layers / "
         "attention_types with window_size) whose real query sees more keys than the window holds: the global mask "
         "on a local layer (TensorRT-Model-Connect 78c8085f1)", local_layers),
)
