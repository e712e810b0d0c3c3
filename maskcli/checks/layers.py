"""Layers of one layer type get one mask: within one forward pass, a layer whose mask differs from the others of its type.

A model builds one mask per layer type and hands it to every layer of that type (transformers'
causal_mask_mapping[layer_type]); the config says which type each layer is (config.py's layer_kind:
layer_types, else sliding_window, attention_chunk_size). So within one call of the outermost module,
the calls of one call site (its layer number left out), one API and one shape, whose layers are of one
type, must all have one mask. Where a strict majority of at least three such layers agree, a layer
whose mask differs is wrong: its type was read from the wrong field for it, or it was handed another
type's mask. The finding names the majority's mask, the layers that have it, and the first cell that
differs.

It speaks only where the config says each layer's type: a config without layer_types that carries another
per-layer field this module does not read (GPT-Neo's attention_layers, ModernBERT's
global_attn_every_n_layers, a per-layer list) leaves the types unknown, and a program with no config at
all is left alone (a hand-written Gemma alternates window and full layers with nothing that says so, and
five sliding layers against one full one is no majority of a type). Where a config rule (config.py)
reports the same group of calls, the engine keeps that finding alone (one bug reported once).
"""

from __future__ import annotations

import re

import numpy as np

from maskcli.checks.arguments import document_starts
from maskcli.checks.config import layer_kind
from maskcli.checks.intent import fields_of, intent
from maskcli.checks.context import Run, equals, first_cell, found_padding, keep, layer, queries
from maskcli.checks.configread import text_part
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans

NUMBER = re.compile(r"(^|\.)\d+(?=\.|$)")  # a layer number in a module path: model.layers.*.self_attn
PATTERNS = ("pattern", "every_n", "attention_layers", "attention_types", "block_type", "window_layers", "interval",
            "no_rope_layers", "global_attn", "local_attn", "stride")  # per-layer fields other than layer_types


def types_known(config) -> bool:
    """The config says each layer's type the way layer_kind reads it: it has layer_types, or no other per-layer field."""
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and types:
        return True
    try:
        fields = vars(config)
    except TypeError:
        return False
    counts = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
    layers = next((fields[n] for n in counts if isinstance(fields.get(n), int)), None)
    for name, value in fields.items():
        given = value is not None and value is not False and not (isinstance(value, (int, float, list, tuple)) and not value)
        if given and any(word in name for word in PATTERNS):
            return False
        if isinstance(value, (list, tuple)) and layers is not None and len(value) == layers and layers > 1:
            return False
    return True


def _kind(run: Run, call, top, index: int) -> tuple[tuple[str, str] | None, object]:
    """(the layer's kind and the field that says so, the config that says it). A config of parts (a vision-language
    model's: Gemma 3's holds text_config and vision_config, and states no layer field itself) speaks through the part
    its modules hold: the call's stated intent (checks/intent.py, scoped by module path), never "every layer full"."""
    config = top.config
    held = run.__dict__.setdefault("_parts", {})
    if id(top) not in held:  # (read once per model call)
        text = text_part(config)
        held[id(top)] = (top, text if text is not config and not fields_of(config) else None)
    text = held[id(top)][1]
    if text is None:
        return layer_kind(config, index), config
    stated = intent(run, call)
    found = stated.kind(index) if stated else None
    return (None if found is None or found[2] else found[:2]), text


def _groups(run: Run) -> dict:
    """(forward pass, call site with its layer number left out, API, shape, step, layer type) -> {layer: first call}."""
    found: dict = {}
    for call in run.calls:
        index = layer(call)
        top = run.top(call)
        if call.stored is None or index is None or top is None or top.config is None:
            continue
        kind, config = _kind(run, call, top, index)
        if kind is None or not types_known(config):
            continue
        site = NUMBER.sub(r"\1*", call.where or "")
        key = (id(top), site, call.api, call.shape, call.step, kind[0], call.details.get("caller"))
        found.setdefault(key, {}).setdefault(index, call)
    return found


def _documents(top, k_len: int) -> str | None:
    """'document(0,0,1,1)' where the model call's cu_seqlens or position_ids (restarting at 0) pack documents into one
    row of k_len tokens; None where they do not."""
    for name in ("cu_seq_lens_k", "cu_seq_lens_q", "cu_seqlens"):
        bounds = top.arguments.get(name)
        if isinstance(bounds, np.ndarray) and bounds.ndim == 1 and len(bounds) > 2 and bounds[-1] == k_len:
            labels = np.searchsorted(bounds, np.arange(k_len), side="right") - 1
            return f"document({','.join(map(str, labels.tolist()))})"
    positions = top.arguments.get("position_ids")
    if isinstance(positions, np.ndarray) and positions.ndim == 2 and positions.shape == (1, k_len):
        labels = document_starts(positions, None)[0]
        if labels[-1] > 0:
            return f"document({','.join(map(str, labels.tolist()))})"
    return None


def _named(cells: np.ndarray, config, kind: str, call, top) -> str | None:
    """The majority's mask as an expression with its padding flags, where one of the config's kinds rebuilds it (with
    the documents the model call's arguments pack)."""
    q_len, k_len = cells.shape[-2:]
    window, chunk = getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)
    candidates = ["causal", "full"]
    if kind == "sliding_attention" and isinstance(window, int) and window > 0:
        candidates.insert(0, f"window({window})")
    if kind == "chunked_attention" and isinstance(chunk, int) and chunk > 0:
        candidates.insert(0, f"local({chunk})")
    documents = _documents(top, k_len)
    if documents is not None:
        candidates = [documents if c == "causal" else f"{documents} & {c}" for c in candidates if c != "full"] + candidates
    if q_len > k_len or call.details.get("slots") is not None:
        return None
    padding = found_padding(cells)
    placed = dict(padding, offset=int(queries(call, top)[0]), kv_len=k_len)
    for expression in candidates:
        if equals(cells, expression, **placed):
            flags = " ".join(f"--{name} {value}" for name, value in padding.items() if name in ("lengths", "pad", "ids"))
            return expression + (f" ({flags})" if flags else "")
    return None


def agree(run: Run) -> list:
    """A layer whose mask differs from a strict majority (three or more layers) of its type in one forward pass."""
    found = []
    for (_, site, _, shape, step, kind, _), calls in _groups(run).items():
        if len(calls) < 3 or any(call.details.get("nan_scores") for call in calls.values()):
            continue  # (NaN scores read as no key, trace/masks.py: where they differ it is the activations', not the mask)
        by_mask: dict = {}
        for index, call in sorted(calls.items()):
            by_mask.setdefault(call.mask, []).append(index)
        cells = {mask: keep(calls[indexes[0]]) for mask, indexes in by_mask.items()}
        if any(value is None for value in cells.values()):
            continue
        merged: dict = {}  # (two stored forms of the same cells are one mask)
        for mask, indexes in by_mask.items():
            same = next((m for m in merged if np.array_equal(np.broadcast_to(cells[m], shape),
                                                             np.broadcast_to(cells[mask], shape))), None)
            merged.setdefault(same if same is not None else mask, []).extend(indexes)
        if len(merged) < 2:
            continue
        major, most = max(merged.items(), key=lambda item: len(item[1]))
        if 2 * len(most) <= len(calls):
            continue
        first = calls[most[0]]
        top = run.top(first)
        said, config = _kind(run, first, top, most[0])
        expected = _named(cells[major], config, kind, first, top)
        field = said[1].split("[")[0]
        for mask, indexes in merged.items():
            if mask == major:
                continue
            call = calls[indexes[0]]
            differ = np.broadcast_to(cells[mask], shape) != np.broadcast_to(cells[major], shape)
            b, h, q, k = first_cell(differ)
            own = queries(call, top)
            sees = "sees" if np.broadcast_to(cells[mask], shape)[b, h, q, k] else "does not see"
            theirs = "theirs does not" if sees == "sees" else "theirs does"
            which, differs = ((f"layer {spans(indexes)} is", "its mask differs") if len(indexes) == 1 else
                              (f"layers {spans(indexes)} are", "their mask differs"))
            found.append((call, Finding("layer-differs", (
                f"{which} {kind} ({field}) as layers {spans(most)} of {site} are, but {differs} from theirs"
                f"{f' ({expected})' if expected else ''}: at step {step} query {int(own[q])} of batch row {b} {sees} key "
                f"{k}, {theirs}"),
                expected=expected or f"the mask of layers {spans(most)}", source=f"config.{field}: layers {spans(most)}",
                cell=(b, int(own[q]), k))))
    return found


RULES = (
    Rule("layer-differs", "wrong", "steps", "a layer whose mask differs from the other layers of its type in one "
         "forward pass (its type read from the wrong field, or another type's mask handed to it)", agree),
)
