"""What each layer's mask should be, read from the model's config as transformers reads it.

A layer's kind: `layer_types[i]` where the config has them (transformers 5 fills them in every
config's __init__: Qwen2's from use_sliding_window and max_window_layers, configuration_qwen2.py
lines 83-90); else `sliding_window` (unless use_sliding_window is False) makes every layer a sliding
one, `attention_chunk_size` a chunked one. A rule here speaks only where the mask is exactly a
specific wrong one (the window one key wider or narrower, plain causal where the window or the chunks
would cut, a window on a full layer): a mask no such expression rebuilds (image spans, documents)
is left to the rules that can name it.
"""

from __future__ import annotations

from maskcli.checks.context import Run, columns_are_positions, equals, found_padding, keep, layer, queries
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def layer_kind(config, index: int | None) -> tuple[str, str] | None:
    """(sliding_attention | full_attention | chunked_attention, the config field that says so) for layer `index`."""
    if config is None or index is None:
        return None
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and types:
        return (str(types[index]), f"layer_types[{index}]") if index < len(types) else None
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window > 0 and getattr(config, "use_sliding_window", True) is not False:
        return "sliding_attention", f"sliding_window={window}"
    if isinstance(getattr(config, "attention_chunk_size", None), int):
        return "chunked_attention", f"attention_chunk_size={config.attention_chunk_size}"
    return "full_attention", "no sliding_window, layer_types or attention_chunk_size"


def _placed(call, run: Run, cells) -> dict | None:
    """How the call's queries sit among its keys, and the padding read off the mask; None where not known."""
    top = run.top(call)
    q_len, k_len = cells.shape[-2:]
    if call.details.get("slots") is not None or q_len > k_len:
        return None
    placed = dict(found_padding(cells))
    if columns_are_positions(call, top):
        placed.update(offset=int(queries(call, top)[0]), kv_len=k_len)
    return placed


def _each_layer_call(run: Run):
    """(call, config, its layer, (kind, field), cells, placing) once per distinct mask, shape and layer kind."""
    done = set()
    for call in run.calls:
        config = run.config(call)
        index = layer(call)
        kind = layer_kind(config, index)
        if kind is None or call.stored is None:
            continue
        key = (call.mask, call.shape, kind[0], call.details.get("queries") and tuple(call.details["queries"]))
        if key in done:
            continue
        done.add(key)
        cells = keep(call)
        placed = None if cells is None else _placed(call, run, cells)
        if placed is not None:
            yield call, config, index, kind, cells, placed


def window(run: Run) -> list:
    """A sliding layer's mask against config.sliding_window: one key wider or narrower, or no window at all."""
    found = []
    for call, config, index, (kind, field), cells, placed in _each_layer_call(run):
        size = getattr(config, "sliding_window", None)
        if kind != "sliding_attention" or not isinstance(size, int) or size < 2:
            continue
        if equals(cells, f"window({size})", **placed):
            continue
        source = f"config.sliding_window={size} ({field})"
        for other in (size + 1, size - 1):
            if equals(cells, f"window({other})", **placed):
                how = "wider" if other > size else "narrower"
                found.append((call, Finding("window-off-by-one", (
                    f"layer {index} sees window({other}), one key {how} than its config's window({size}): an "
                    f"off-by-one (sliding_window counts the query itself, FlashAttention's window_size=(W-1, 0))"),
                    expected=f"window({size})", source=source)))
                break
        else:
            if equals(cells, "causal", **placed):
                found.append((call, Finding("window-missing", (
                    f"layer {index} is a sliding layer ({field}) but its mask is causal: queries see keys "
                    f"{size} or more positions back"), expected=f"window({size})", source=source)))
    return found


def full_layers(run: Run) -> list:
    """A full-attention layer (by layer_types) given a sliding window: the window read from the wrong field."""
    found = []
    for call, config, index, (kind, field), cells, placed in _each_layer_call(run):
        size = getattr(config, "sliding_window", None)
        if kind != "full_attention" or not isinstance(size, int) or size < 1 or equals(cells, "causal", **placed):
            continue
        if any(equals(cells, f"window({w})", **placed) for w in (size, size + 1, size - 1) if w >= 1):
            found.append((call, Finding("window-on-full-layer", (
                f"layer {index} is a full-attention layer ({field}) but its mask is a sliding window of about "
                f"{size} keys: the window applied to every layer, not by layer_types"), expected="causal", source=field)))
    return found


def chunks(run: Run) -> list:
    """A chunked layer (Llama 4's attention_chunk_size) whose mask is causal across the chunks."""
    found = []
    for call, config, index, (kind, field), cells, placed in _each_layer_call(run):
        size = getattr(config, "attention_chunk_size", None)
        if kind != "chunked_attention" or not isinstance(size, int) or size < 1:
            continue
        if not equals(cells, f"local({size})", **placed) and equals(cells, "causal", **placed):
            found.append((call, Finding("chunks-missing", (
                f"layer {index} is a chunked layer ({field}) but its mask is causal across chunks of {size}"),
                expected=f"local({size})", source=f"config.attention_chunk_size={size}")))
    return found


RULES = (
    Rule("window-off-by-one", "wrong", "steps", "a sliding layer whose window is one key wider or narrower than the "
         "config's sliding_window", window),
    Rule("window-missing", "wrong", "steps", "a sliding layer (layer_types, sliding_window) whose mask has no window",
         window),
    Rule("window-on-full-layer", "wrong", "steps", "a full-attention layer given the sliding window (layer types read "
         "from the wrong field)", full_layers),
    Rule("chunks-missing", "wrong", "steps", "a chunked layer (attention_chunk_size) whose mask is causal across "
         "chunks", chunks),
)
