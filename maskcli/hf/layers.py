"""Each layer type of a family as a maskcli expression, read off its config as transformers reads it.

full_attention is causal; sliding_attention sees its `sliding_window` keys, itself included (causal &
window(W): transformers/masking_utils.py:97 keeps kv > q - W, and-ed with causal at :136); chunked_attention sees its own
chunk of `attention_chunk_size` up to itself (local(C): masking_utils.py:109 and :163, no left padding). Other layer types
(linear attention, state-space layers) hold no attention mask and are left out, by name.
One reading of the config (_read), two views: `expressions` for `shard --model`, `layer_masks` (the same reading as
parameters) for `serve --model` to compare with a batch's window or chunk.
"""

from __future__ import annotations

from maskcli.errors import MaskError
from maskcli.hf.families import layer_types, load


def _read(config, types: list[str]) -> dict[str, tuple[str, int | None] | None]:
    """{layer type: ("full", None) | ("window", W) | ("chunk", C) | None}, in the order the layers first use them: the
    one reading of the config both views give. None: a layer type with no attention mask (linear attention, mamba);
    W or C None: a sliding or chunked layer whose config leaves its size unset."""
    sizes = {"window": getattr(config, "sliding_window", None), "chunk": getattr(config, "attention_chunk_size", None)}
    found: dict[str, tuple[str, int | None] | None] = {}
    for kind in dict.fromkeys(types):
        what = "window" if kind.startswith("sliding") else "chunk" if kind.startswith("chunked") else \
            "full" if kind.startswith("full") else None
        size = sizes.get(what)
        found[kind] = None if what is None else (what, int(size) if size else None)
    return found


def expressions(source: str) -> tuple[dict[str, str], list[str]]:
    """({layer type: expression} in the order the layers first use them, [layer types without a mask]); a sliding or
    chunked layer whose config has no size is an error (shard needs every layer's mask)."""
    config = load(source)
    found: dict[str, str] = {}
    skipped: list[str] = []
    for kind, mask in _read(config, layer_types(config)).items():
        if mask is None:
            skipped.append(kind)
            continue
        what, size = mask
        if what != "full" and size is None:
            field = "sliding_window" if what == "window" else "attention_chunk_size"
            raise MaskError(f"{source}: its layers include {kind} but its config has no {field}")
        found[kind] = {"full": "causal", "window": f"causal & window({size})", "chunk": f"local({size})"}[what]
    if not found:
        raise MaskError(f"{source}: none of its layer types ({', '.join(skipped)}) holds an attention mask to shard")
    return found, skipped


def layer_masks(source: str) -> tuple[dict[str, tuple[str, int | None]], list[str]]:
    """({layer type: ("window", W) | ("chunk", C) | ("full", None)}, each layer's type) from a family or config.json.

    A window or chunk the config leaves unset is none (full), as transformers builds no overlay for it; layer types
    with no attention (linear attention, mamba) read no paged KV cache and are left out.
    """
    config = load(source)
    types = layer_types(config)
    masks = {kind: ("full", None) if mask[1] is None else mask for kind, mask in _read(config, types).items() if mask}
    return masks, types
