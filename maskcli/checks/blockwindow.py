"""A local attention that ran in blocks of its own default window where its model states another window.

A local attention over non-overlapping windows reshapes its sequence into blocks of its window and attends within
each (snac's `LocalMHA`: `T // window_size` blocks of `window_size` frames, each an SDPA plane of as many queries as
keys). The layer holds that window as a plain int (`self.window_size`); the model that built it states the window it
was configured with as an attribute or a config of its own (snac's `SNAC.attn_window_size`), read on the running
modules at the call (trace/blockwindows.py). Where the kernel's blocks are the layer's own window (as many keys as it
states, the innermost statement) while a module around it states another window, the configured window never
reached the layer: it ran with its default (hubertsiuzdak/snac 946c3bf: `SNAC.__init__` did not pass
`attn_window_size` to its `Encoder` and `Decoder`, whose `LocalMHA` kept 32 frames). Quiet where every statement
agrees, where the blocks are not the innermost statement's size (another convention: a 2-D window of h x w keys), and
on cross-attention and on calls of one query.
"""

from __future__ import annotations

from maskcli.checks.context import Run, cross
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def block_window(run: Run) -> list:
    """Calls whose blocks are the attending layer's own window where an outer module states another."""
    found, done = [], {}
    for call in [*run.calls, *run.unmasked]:
        stated = call.details.get("block_windows")
        q_len, k_len = call.shape[2], call.shape[3]
        if not stated or q_len != k_len or q_len < 2 or cross(call):
            continue
        own, layer = stated[-1]
        other = next(((value, where) for value, where in stated[:-1] if value != own), None)
        if own != k_len or other is None:
            continue
        key = (tuple(stated), k_len)
        if key not in done:
            done[key] = Finding("window-not-handed", (
                f"the kernel attends in blocks of {k_len} keys, the window {layer} holds, while {other[1]} states a "
                f"window of {other[0]}: the window the model was configured with never reached this layer, which "
                f"kept its own"), expected=f"blocks of {other[0]} keys", source=other[1],
                cell=(0, 0, other[0]) if other[0] < k_len else None)  # (query 0 of the first block sees key W)
        found.append((call, done[key]))
    return found


RULES = (
    Rule("window-not-handed", "wrong", "call", "a local attention that attends in blocks of its own window where a "
         "module around it states another window (the configured window never passed to the layer)", block_window),
)
