"""A window stated under another project's field names, read as the names checks/intent.py reads.

Transformer-XL's `mem_len` with `same_length=True` and `attn_type` "uni": every query sees mem_len keys, itself the
last (a sliding window of mem_len). llama.cpp's `llama_hparams` (and its Python ports): `n_swa` the window of its
standard SWA (`is_masked_swa`: masked where p1 - p0 >= n_swa, so a query sees n_swa keys, itself among them; the
chunked type's n_swa is a chunk size, not a window, and the NONE type slides not at all) and `swa_layers` one bool a
layer (`is_swa(il)`), which is sliding_window_layers' bool form. Gemma 3n's and Gemma 4's audio encoders'
`attention_context_right`: the frames past its own a query sees (`max_future_horizon`, transformers'
`_convert_4d_mask_to_blocked_5d`); 0 states it sees none, a causal statement beside its blocks and left context.

A `window_size` beside a capacity past it (H2O's and SnapKV's `max_capacity_prompt`, a `budget`) or the share of the
keys kept (kvpress's `compression_ratio`) is a KV-cache compressor's observation window (the last queries, that score
which keys to keep), not the attention's: left out (trace/bounded.py reads a cache object's window the same way).

A config that names Gemma 2 (its `name`, `model_type`, `model_name`: gemma-2, gemma2; not Gemma 1's gemma-2b) with a
window and no layer pattern states Gemma 2's layers: sliding and full in turn, the first sliding (transformers'
configuration_gemma2.py: layer_types "sliding_attention" where (i + 1) % 2, a sliding_window_pattern of 2).
"""

from __future__ import annotations

import re

CAPACITY = re.compile(r"capacity|budget|max_(size|len|length|tokens|cache)|cache_size", re.I)
GEMMA2 = re.compile(r"(?<![a-z0-9])gemma[-_ ]?2(?![0-9a-z])", re.I)
NAMED = ("name", "model_type", "model_name")
PATTERNS = ("layer_types", "sliding_window_pattern", "sliding_window_layers", "max_window_layers", "interleaved_attn_pattern")
RATIO = re.compile(r"(?:compression|keep|retain|evict|prune)\w*_ratio|ratio_(?:kept|evicted)", re.I)

STANDARD = 1  # llama.cpp's LLAMA_SWA_TYPE_STANDARD (NONE 0, CHUNKED 2, SYMMETRIC 3)


def _standard(kind) -> bool:
    """llama.cpp's swa_type says the standard (causal) sliding window: its int, or an enum member named so; absent
    (a port that keeps n_swa alone) it is."""
    if kind is None:
        return True
    if type(kind) is int:
        return kind == STANDARD
    return str(getattr(kind, "name", kind)).upper().endswith("STANDARD")


def observation_window(attributes: dict, window: int) -> bool:
    """The object also states a capacity past its window or the share of the keys it keeps: it keeps that many keys,
    its window being another one (H2O's and SnapKV's observation window)."""
    return any(type(value) is int and value > window and CAPACITY.search(name)
               or type(value) is float and 0 < value < 1 and RATIO.search(name) for name, value in attributes.items()
               if isinstance(name, str))


def other_names(items: dict, found: dict, model: str | None = None) -> None:
    """Add to `found` (the fields read under checks/intent.py's names) what `items` states under the other names
    above, where the names it reads state nothing of it; `window_said` names the field the window came from. A
    compressor's observation window is taken out of it."""
    if type(found.get("window_size")) is int and observation_window(items, found["window_size"]):
        del found["window_size"]
    if "sliding_window" not in found and items.get("same_length") is True and type(items.get("mem_len")) is int \
            and items["mem_len"] > 0 and items.get("attn_type", "uni") == "uni":
        found["sliding_window"], found["window_said"] = items["mem_len"], "mem_len"
    named = next((f"{n}={items[n]!r}" for n in NAMED if isinstance(items.get(n), str) and GEMMA2.search(items[n])), None)
    if named and not any(n in found for n in PATTERNS) and any(found.get(n) for n in ("sliding_window", "sliding_window_size")):
        found["sliding_window_pattern"] = 2
        found["pattern_said"] = f"{named} (Gemma 2: sliding and full layers in turn, the first sliding)"
    whole = items.get("local_attention")  # (ModernBERT's whole local window, beside sliding_window its half: bothways.py;
    # of transformers' configs, only the encoder's, ModernBertConfig: modernbert-decoder's window is causal)
    if type(whole) is int and found.get("sliding_window") == whole // 2 and model in (None, False, "modernbert"):
        found["local_attention"] = whole
    swa = items.get("n_swa")
    if "sliding_window" not in found and type(swa) is int and swa > 0 and _standard(items.get("swa_type")):
        found["sliding_window"], found["window_said"] = swa, "n_swa"
        layers = items.get("swa_layers")
        if "sliding_window_layers" not in found and isinstance(layers, (list, tuple)) and layers \
                and all(isinstance(x, bool) for x in layers):
            found["sliding_window_layers"], found["layers_said"] = list(layers), "swa_layers"


def no_right_context(values: dict) -> dict:
    """{"attention_context_right": True} where the config states its queries see no frame past their own (0)."""
    right = values.get("attention_context_right")
    return {"attention_context_right": True} if type(right) is int and right == 0 else {}
