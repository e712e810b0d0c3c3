"""Each layer type's window or chunk as a config states it, for `serve --model`: what masks those layers build.

transformers' masking_utils.py: sliding_window_overlay keeps kv_idx > q_idx - sliding_window (W keys including
the query's own, maskcli's window(W)); chunked_overlay keeps the query's attention_chunk_size-aligned chunk
(local(C)). full_attention attends every earlier key; other layer types (linear attention, mamba, ...) read
no paged KV cache and are left out.
"""

from __future__ import annotations

from maskcli.hf.families import layer_types, load


def layer_masks(source: str) -> tuple[dict[str, tuple[str, int | None]], list[str]]:
    """({layer type: ("window", W) | ("chunk", C) | ("full", None)}, each layer's type) from a family or config.json."""
    config = load(source)
    types = layer_types(config)
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    masks: dict[str, tuple[str, int | None]] = {}
    for kind in dict.fromkeys(types):
        if kind.startswith("sliding") and window:
            masks[kind] = ("window", int(window))
        elif kind.startswith("chunked") and chunk:
            masks[kind] = ("chunk", int(chunk))
        elif kind.startswith(("full", "sliding", "chunked")):  # a window or chunk the config leaves unset is none
            masks[kind] = ("full", None)
    return masks, types
