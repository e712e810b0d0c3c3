"""Cached keys an earlier call read, read again scaled by one factor: a move that was no rotation.

trace/keyscale.py records, at an SDPA call, the keys an earlier call of the run read that come back with the same
direction in every rotary pair and every pair's norm times one factor c, not 1. Moving a cached key to another
position (a press that prunes the cache and re-rotates what it keeps: kvpress' KeyRerotationPress) turns its pairs,
which keeps their norms: a key scaled on the way gives every query c times the logit it gave the same key before,
while the fresh keys of the same call are not scaled (NVIDIA/kvpress#85: keys un-rotated and re-rotated with the
layer's `position_embeddings`, whose cos/sin carry YaRN's `attention_scaling`, so c = attention_scaling²; the fix
rotates by the position delta from `inv_freq`, a pure rotation). Said once per site. Quiet where kept keys come back
unscaled (re-rotated, or kept where they were), and where no key comes back (a cache that stores keys of its own
quantization, a new input).
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def keys_rescaled(run: Run) -> list:
    """The first call per site whose keys of earlier calls come back scaled by one factor."""
    found, done = [], set()
    for call in run.calls:
        held = call.details.get("keys_rescaled")
        if not isinstance(held, dict) or call.where in done:
            continue
        done.add(call.where)
        factor = held["factor"]
        said = (f"{call.where}: {held['keys']} of the {held['of']} keys of batch row 0's first head this call reads are keys an "
                f"earlier call read, each with the same direction in every rotary pair and every pair's norm times "
                f"{factor:g}: moving a cached key to another position is a rotation, which keeps each pair's norm, so "
                f"these were scaled on the way and every query now gives them {factor:g} times the logit it gave them "
                f"before, beside fresh keys that are not (a re-rotation made with cos/sin that carry a scaling, as "
                f"YaRN's attention_scaling: rotate by the position delta from inv_freq alone)")
        found.append((call, Finding("keys-rescaled", said, expected="cached keys kept or rotated, norms unchanged",
                                    source="the keys of an earlier call", cell=(0, 0, 0))))
    return found


RULES = (
    Rule("keys-rescaled", "wrong", "steps", "cached keys that an earlier call read, read again with every rotary pair's "
         "norm times one factor: moved by something that is not a rotation (re-rotated with scaled cos/sin)",
         keys_rescaled),
)
