"""A pooled query of a causal module that sees the tokens after those it pooled.

trace/poolspan.py records, at a call of a module that states itself causal (`self.causal = True`), a query per batch
row that the program's frames hold as the mean of each bucket of s tokens of a sequence shifted right by k, beside the
keys' source: that sequence, unshifted, cut into the same buckets (`(b n) s d`, a bucket per batch row). So the query
of bucket n holds the tokens n·s - k .. n·s + s - 1 - k, and the keys of its row are tokens n·s .. n·s + s - 1: the
last k of them come after every token the query holds. A causal module's query sees no key after its own tokens; the
kernel's causal alignment puts the one query at the bucket's last key, which only the unshifted pooling (k = 0) holds.
hourglass-transformer-pytorch d7dc1e0: the pre-valley attention resampling pooled the sequence shifted by s - 1 and
attended the unshifted bucket `x_residual`, so after upsampling position n·s saw bytes n·s + 1 .. n·s + s - 1 (its fix
attends the shifted `x` it pooled). Quiet where the query pools its own keys (k = 0), on a module that states nothing
causal, and where the kernel hides those later keys.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def pooled_later(run: Run) -> list:
    """Calls whose pooled query (one per bucket, of the shifted sequence) sees its bucket's keys after its tokens."""
    found, done = [], set()
    for call in [*run.calls, *run.cross]:
        held = call.details.get("pooled_shift")
        flag = call.details.get("module_causal")
        if not isinstance(held, dict) or not flag or call.mask in done:
            continue
        rows, size, shift = held["rows"], held["size"], held["shift"]
        if not 0 < shift < size or call.shape[0] != rows or call.shape[2] != 1 or call.shape[3] != size:
            continue
        cells = keep(call)
        if cells is None:
            continue
        seen = np.broadcast_to(cells, (rows, *cells.shape[1:])).any(axis=(1, 2))  # (rows, keys): seen by some head
        later = seen & (np.arange(size) > size - 1 - shift)[None, :]
        if not later.any():
            continue
        done.add(call.mask)
        b, k = (int(x) for x in np.argwhere(later)[0])
        said = (f"{call.where}'s module states causal={flag}, but its one query per batch row is `{held['query']}`, "
                f"the mean of each bucket of {size} tokens of `{held['keys']}`'s sequence shifted right by {shift}: it "
                f"holds its bucket's tokens up to {size - 1 - shift}, yet sees the bucket's keys from `{held['keys']}` "
                f"unshifted, {size - shift}-{size - 1} among them ({int(later.sum())} batch rows x keys; batch row {b}, "
                f"key {k}): tokens after every one it pooled (attend the shifted sequence the query was pooled from)")
        found.append((call, Finding("pooled-query-sees-later", said, expected=f"keys up to {size - 1 - shift}",
                                    source=flag, cell=(b, 0, k))))
    return found


RULES = (
    Rule("pooled-query-sees-later", "wrong", "call", "a causal module's pooled query (the mean of a bucket of the "
         "sequence shifted right) that sees its bucket's keys of the unshifted sequence, after every token it pooled",
         pooled_later),
)
