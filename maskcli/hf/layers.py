"""Each layer type of a family as a maskcli expression, read off its config as transformers reads it.

full_attention is causal; sliding_attention sees its `sliding_window` keys, itself included (causal &
window(W): transformers/masking_utils.py:97 keeps kv > q - W, and-ed with causal at :136); chunked_attention sees its own
chunk of `attention_chunk_size` up to itself (local(C): masking_utils.py:109 and :163, no left padding). Other layer types
(linear attention, state-space layers) hold no attention mask and are left out, by name.
`layer_masks` gives the same reading as parameters, for `serve --model` to compare with a batch's window or chunk.
"""

from __future__ import annotations

from maskcli.errors import MaskError
from maskcli.hf.families import layer_types, load


def expressions(source: str) -> tuple[dict[str, str], list[str]]:
    """({layer type: expression} in the order the layers first use them, [layer types without a mask])."""
    config = load(source)
    found: dict[str, str] = {}
    skipped: list[str] = []
    for kind in dict.fromkeys(layer_types(config)):
        if kind == "full_attention":
            found[kind] = "causal"
        elif kind == "sliding_attention":
            window = getattr(config, "sliding_window", None)
            if not window:
                raise MaskError(f"{source}: its layers include sliding_attention but its config has no sliding_window")
            found[kind] = f"causal & window({int(window)})"
        elif kind == "chunked_attention":
            size = getattr(config, "attention_chunk_size", None)
            if not size:
                raise MaskError(f"{source}: its layers include chunked_attention but its config has no attention_chunk_size")
            found[kind] = f"local({int(size)})"
        else:
            skipped.append(kind)
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
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    masks: dict[str, tuple[str, int | None]] = {}
    for kind in dict.fromkeys(types):
        if kind.startswith("sliding") and window:
            masks[kind] = ("window", int(window))
        elif kind.startswith("chunked") and chunk:
            masks[kind] = ("chunk", int(chunk))
        elif kind.startswith(("full", "sliding", "chunked")):
            masks[kind] = ("full", None)
    return masks, types
