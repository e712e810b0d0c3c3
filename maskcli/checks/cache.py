"""The cache: a key column the cache never wrote must not be attended.

A static cache (transformers' StaticCache, gpt-fast's KVCache) hands attention all of its slots,
slot j holding position j once written. The model call says which positions it writes
(`cache_position`, gpt-fast's `input_pos`), or a Hugging Face cache says how many tokens it holds:
past them no slot holds a key yet (its zeros, or a previous run's stale keys). A query that sees such
a slot attends to nothing the program wrote; only real queries are judged (checks/real.py: a left-padded prompt's
padding queries see every slot where transformers unmasks their rows whole, so that they give no NaN). An encoder-decoder's cross-attention keys are its
encoder's, so it is left alone. `model` checks each column against the slot its cache returned, read
off the keys themselves (maskcli.hf.cache, widths.py: it wraps Cache.update and keeps a copy of every
key); trace reads the cache's own count instead, which costs nothing and needs no transformers here.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.real import by_row, resolve
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _written(call, top) -> tuple[np.ndarray, str] | None:
    """(the positions this call writes, what says so) for a call over a static cache's slots, else None: no slot past
    the last of them holds a key.

    gpt-fast's and transformers' older calls say which positions they write (`input_pos`, `cache_position`): the
    slots past the last one hold no key. transformers 5.24's generate passes neither to a static cache's model call;
    trace then reads the cache itself (trace/tops.py): its tokens once the call wrote its own (`cache_length`) and
    its static layers' slot counts (`cache_slots`). A call whose keys are one static layer's whole buffer has
    slots [0, cache_length) written and the rest empty: a full layer always (cache_utils.py StaticLayer.update,
    462-494), a sliding one until it fills (StaticSlidingWindowLayer.update, 602-618); once full, a sliding layer
    returns its last window in order, all written (583-588, 621-624), never more keys than it holds.
    """
    q_len, k_len = call.shape[2:]
    for name in ("cache_position", "input_pos"):
        found = top.arguments.get(name)
        if isinstance(found, np.ndarray) and found.size:
            found = found.reshape(-1)
            return (found, name) if len(found) == q_len else None
    held, sizes = top.arguments.get("cache_length"), top.arguments.get("cache_slots") or ()
    if isinstance(held, int) and k_len in sizes and q_len <= held:
        cache = top.arguments.get("past_key_values", "cache")
        return np.arange(held - q_len, held), ("its cache dict's cache_index" if cache == "dict" else f"the {cache}'s length")
    return None


def unwritten(run: Run) -> list:
    found, done = [], set()
    for call in run.calls:
        top = run.top(call)
        if top is None or getattr(top.config, "is_encoder_decoder", False) or call.details.get("slots") is not None:
            continue
        written = _written(call, top)
        if written is None or call.mask in done:
            continue
        positions, said = written
        end = int(positions.max()) + 1
        k_len = call.shape[3]
        if k_len <= end:
            continue
        done.add(call.mask)
        cells = keep(call)
        if cells is None:
            continue
        rows = max(cells.shape[0], call.shape[0])
        real = resolve(call, top, by_row(cells, rows)).queries  # (B, Lq): a padding query's row is unmasked whole on
        if cells.shape[0] == 1 and (real == real[:1]).all():  # purpose (no NaN); a mask broadcast over the batch
            real = real[:1]  # rows is counted once, as stored
        bad = cells[..., end:] & real[:, None, :, None]
        if bad.any():
            b, h, q, k = first_cell(bad)
            query, count = int(positions[q]), int(bad.sum())
            found.append((call, Finding("unwritten-slot", (
                f"query {query} sees cache slot {end + k} of {k_len}, which holds no key yet: this call's cache holds "
                f"positions up to {end - 1} ({said}); {count} such cell{'s' if count > 1 else ''}"),
                expected=f"no key past slot {end - 1}", source=f"{said} of {top.where}", cell=(b, query, end + k))))
    return found


RULES = (
    Rule("unwritten-slot", "wrong", "steps", "a static cache's slots not yet written, attended (the mask built for "
         "the written length, or none)", unwritten),
)
