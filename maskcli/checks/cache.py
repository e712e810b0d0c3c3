"""The cache: a key column the cache never wrote must not be attended.

A static cache (transformers' StaticCache, gpt-fast's KVCache) hands attention all of its slots,
slot j holding position j once written. The model call says which positions it writes
(`cache_position`, gpt-fast's `input_pos`): past the last of them no slot holds a key yet (its
zeros, or a previous run's stale keys). A query that sees such a slot attends to nothing the
program wrote. An encoder-decoder's cross-attention keys are its encoder's, so it is left alone;
`model` checks each column against the slot its cache returned (maskcli.hf.cache, widths.py).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _written(top) -> np.ndarray | None:
    for name in ("cache_position", "input_pos"):
        found = top.arguments.get(name)
        if isinstance(found, np.ndarray) and found.size:
            return found.reshape(-1)
    return None


def unwritten(run: Run) -> list:
    found, done = [], set()
    for call in run.calls:
        top = run.top(call)
        written = None if top is None else _written(top)
        if written is None or getattr(top.config, "is_encoder_decoder", False) or call.details.get("slots") is not None:
            continue
        last = int(written.max())
        q_len, k_len = call.shape[2:]
        if k_len <= last + 1 or len(written) != q_len or call.mask in done:
            continue
        done.add(call.mask)
        cells = keep(call)
        if cells is None:
            continue
        bad = cells[..., last + 1:]
        if bad.any():
            b, h, q, k = first_cell(bad)
            found.append((call, Finding("unwritten-slot", (
                f"query {int(written[q])} sees cache slot {last + 1 + k} of {k_len}, which holds no key yet: this call "
                f"writes positions up to {last} ({'cache_position' if 'cache_position' in top.arguments else 'input_pos'})"
                f"; {int(bad.sum())} such cells"), expected=f"no key past slot {last}",
                source=f"cache_position of {top.where}", cell=(b, int(written[q]), last + 1 + k))))
    return found


RULES = (
    Rule("unwritten-slot", "wrong", "steps", "a static cache's slots not yet written, attended (the mask built for "
         "the written length, or none)", unwritten),
)
