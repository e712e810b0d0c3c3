"""Each step's mask against the keys its layer's cache returned: as wide, and its key columns on the positions
the cache's slots hold; the first cell (layer, step, query, key) where not is named.

The mask's key column j stands for position kv_offset + j (what the cache told masking_utils); the slot j the
cache returned holds the position maskcli.hf.cache read off the keys. A mask narrower than the keys is fine only
where the keys it leaves out are slots not yet written (SDPA's is_causal path cuts a static cache's empty tail).
"""

from __future__ import annotations

import numpy as np

from maskcli.text import spans


def check(calls: list, updates: list, step_names: list[str], shared: int = 0) -> tuple[list[str], bool, dict | None]:
    """(lines, holds, first): every call of the numbered layers against its layer's cache call at the same step.
    `shared`: the config's num_kv_shared_layers, its last layers reusing earlier layers' keys (no cache of their own)."""
    by_call = {(u.layer, u.step): u for u in updates}
    lines: list[str] = []
    first = None
    differ: list[int] = []
    unseen: set[int] = set()
    for call in sorted(calls, key=lambda c: (c.step, c.details["layer"])):
        layer = call.details["layer"]
        update = by_call.get((layer, call.step))
        if update is None or call.stored is None or call.stored["form"] == "stats":
            unseen.add(layer)
            continue
        found = _first_cell(call, update)
        if found is None:
            continue
        differ.append(call.index)
        if first is None:
            step = step_names[call.step] if call.step < len(step_names) else f"step {call.step}"
            query, key, why = found
            first = {"layer": layer, "layer_type": call.details["layer_type"], "step": step, "query": query, "key": key,
                     "call": call.index, "why": why}
            lines.append(f"cache: layer {layer} ({call.details['layer_type']}) at {step}: {why}; first cell: query "
                         f"{query}, key column {key}")
    if len(differ) > 1:
        lines.append(f"cache: {len(differ) - 1} more calls' masks disagree with their caches' keys: calls {spans(differ[1:])}")
    holds = not differ
    compared = len(calls) - sum(1 for c in calls if c.details["layer"] in unseen)
    if holds:
        lines.append(f"cache: each step's mask is as wide as the keys its cache returned, on their positions ({compared} calls)")
    last = max((c.details["layer"] for c in calls), default=-1)
    reusing = {layer for layer in unseen if shared and layer > last - shared}
    if reusing:
        lines.append(f"cache: layer{'s' if len(reusing) > 1 else ''} {spans(sorted(reusing))} reuse earlier layers' keys "
                     f"(num_kv_shared_layers {shared}) and write no cache of their own: not compared")
    if unseen - reusing:
        lines.append(f"cache: layer{'s' if len(unseen - reusing) > 1 else ''} {spans(sorted(unseen - reusing))}: no cache "
                     "call seen for some step (a cache of the family's own?): not compared there")
    return lines, holds, first


def _first_cell(call, update) -> tuple[int, int, str] | None:
    """(query position, key column, why) of the first cell where the mask and the cache's keys disagree, or None."""
    keep = call.keep()  # (B, H, Lq, Lk)
    q_len, k_len = keep.shape[2:]
    q0 = call.details["queries"][0]
    slots = update.slots
    n = len(slots)
    attended = keep.any(axis=(0, 1))  # (Lq, Lk)

    def query(column: int) -> int:
        rows = np.flatnonzero(attended[:, column]) if column < k_len else []
        return q0 + int(rows[0]) if len(rows) else q0

    if k_len > n:
        return query(n), n, f"the mask has {k_len} key columns, the cache returned {n} keys"
    if k_len < n and (slots[k_len:] >= 0).any():
        j = k_len + int(np.argmax(slots[k_len:] >= 0))
        return q0, j, (f"the mask has {k_len} key columns, the cache returned {n} keys (slot {j} holds position "
                       f"{slots[j]}, which no query can see)")
    held = slots[:k_len]
    empty = (held < 0) & attended.any(axis=0)
    wrong = np.zeros(k_len, dtype=bool)
    if update.sizes is not None:
        meant = update.sizes[1] + np.arange(k_len)
        wrong = (held >= 0) & (held != meant)
    bad = np.flatnonzero(empty | wrong)
    if not len(bad):
        return None
    j = int(bad[0])
    if wrong[j]:
        return query(j), j, (f"the mask's key column {j} is position {update.sizes[1] + j} (kv_offset {update.sizes[1]}), "
                             f"the cache's slot {j} holds position {held[j]}")
    return query(j), j, f"the mask lets a query attend key column {j}, and the cache's slot {j} holds no key yet"


def order_notes(calls: list, updates: list, step_names: list[str]) -> list[str]:
    """Where a layer's slots do not hold their positions in order (a ring buffer): which slots held which positions."""
    by_call = {(u.layer, u.step): u for u in updates}
    notes = []
    for call in sorted(calls, key=lambda c: (c.step, c.details["layer"])):
        update = by_call.get((call.details["layer"], call.step))
        if update is None or update.in_order():
            continue
        step = step_names[call.step] if call.step < len(step_names) else f"step {call.step}"
        held = ", ".join(f"slot {j}: {'none' if p < 0 else p}" for j, p in enumerate(update.slots.tolist()[:16]))
        notes.append(f"cache: layer {call.details['layer']} ({call.details['layer_type']}) at {step}: its slots are not in "
                     f"position order ({held}{', ...' if len(update.slots) > 16 else ''})")
    return notes
