"""Each layer type of a family as a mask, read off its config as transformers reads it: the one reading of a config's
per-layer masks, for `shard --model` (a mask per layer type) and `serve --model` (a batch's window or chunk against them,
checks/serveexpect.py). Which layer is which type is families.layer_types', the reading `model` and trace's rules use.

full_attention is causal; sliding_attention sees its `sliding_window` keys, itself included (causal &
window(W): transformers/masking_utils.py:97 keeps kv > q - W, and-ed with causal at :136); chunked_attention sees its own
chunk of `attention_chunk_size` up to itself (local(C): masking_utils.py:109 and :163, no left padding). Other layer types
(linear attention, state-space layers) hold no attention mask and are left out, by name.
"""

from __future__ import annotations

from maskcli.errors import MaskError
from maskcli.hf.families import layer_types, load

MISSING = ("full", "error")  # what a sliding or chunked layer whose config leaves its size unset is


def layer_masks(source: str, missing: str = "full") -> tuple[dict[str, tuple[str, int | None]], list[str], list[str]]:
    """({layer type: ("full", None) | ("window", W) | ("chunk", C)} in the order the layers first use them, each
    layer's type, [layer types with no attention mask]) from a family or config.json.

    A sliding or chunked layer type whose config leaves its size unset is `missing`: "full", as transformers builds no
    overlay for it (serve compares a batch with that); "error", where every layer's mask is needed (shard).
    """
    if missing not in MISSING:
        raise ValueError(f"missing={missing!r}: one of {MISSING}")
    config = load(source)
    types = layer_types(config)
    sizes = {"window": getattr(config, "sliding_window", None), "chunk": getattr(config, "attention_chunk_size", None)}
    masks: dict[str, tuple[str, int | None]] = {}
    skipped: list[str] = []
    for kind in dict.fromkeys(types):
        what = "window" if kind.startswith("sliding") else "chunk" if kind.startswith("chunked") else \
            "full" if kind.startswith("full") else None
        if what is None:
            skipped.append(kind)
            continue
        size = sizes.get(what)
        if what != "full" and not size and missing == "error":
            field = "sliding_window" if what == "window" else "attention_chunk_size"
            raise MaskError(f"{source}: its layers include {kind} but its config has no {field}")
        masks[kind] = (what, int(size)) if what != "full" and size else ("full", None)
    return masks, types, skipped


def bound(mask: tuple[str, int | None]):
    """A layer type's mask, ("full", None) | ("window", W) | ("chunk", C), as terms bound to their kinds (causal,
    causal & window(W), local(C)): and-ed into a Mask as they are (mask.build's after), nothing parsed."""
    from maskcli import expression as ex
    from maskcli import terms
    from maskcli.kinds import get as get_kind

    what, size = mask
    causal = terms.bound(get_kind("causal"), {})
    if what == "window":
        return ex.both(causal, terms.bound(get_kind("window"), {"window": size}))
    return terms.bound(get_kind("local"), {"chunk_size": size}) if what == "chunk" else causal


def expression(mask: tuple[str, int | None]) -> str:
    """A layer type's mask as a maskcli expression, to be shown: its terms' text."""
    from maskcli import terms

    return terms.text(bound(mask))
