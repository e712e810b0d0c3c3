"""Two steps of one call site that number one row's tokens two ways (positions-vs-keys, checks/positioned.py).

A row's first query at a cached step that sees every key the row's last query of the site's previous step saw, and
one more (its own: the cache grew by that token, nothing dropped), is that token's successor, wherever either step
put the row's padding: its position is the other's plus one. positioned.py holds a step to the one before only where
that one's last query sat at as many positions as it saw keys; this reads the rest, where the previous step numbered
its tokens otherwise than its keys count (padding counted, or a prefix, a soft prompt) and the next step numbers
them the other way: the two steps disagree, so rotary or learned position embeddings place the cached tokens and the
new ones on two scales (transformers#43132: generate's chunked prefill handed each chunk `cache_position` for its
`position_ids`, counting a left-padded row's pads, where the decode steps number from the attention mask).
Only over the same batch rows (a loop that drops finished rows renumbers its rows), and only where the later query
sees the earlier one's keys, all of them, in the same columns.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Mark(NamedTuple):
    """What a step's last real query of a row leaves for the next step."""

    position: int
    count: int  # the keys it sees
    counted: bool  # its position counts its keys (position + 1 == count)
    rows: int  # the step's batch rows
    seen: np.ndarray  # bool (Lk,): the keys it sees


def mark(position: int, count: int, batch: int, seen: np.ndarray) -> Mark:
    return Mark(position, count, position + 1 == count, batch, seen.copy())


def follows(before: Mark, seen: np.ndarray, batch: int) -> bool:
    """The next step's first query of the row (bool (Lk,) the keys it sees) sees the keys `before`'s query saw, in the
    same columns, and one more, over as many batch rows."""
    old = before.seen
    return batch == before.rows and seen.shape[0] > old.shape[0] and bool((seen[:old.shape[0]] >= old).all()) \
        and int(seen.sum()) == int(old.sum()) + 1


def why(before: Mark, position: int, pads: int) -> str | None:
    """The cause said where the previous step's position did not count its keys (None where it did: positioned.py's
    own words): its positions counted the row's padding keys, or more tokens than it saw, and this step's do not."""
    if before.counted:
        return None
    ahead = before.position + 1 - before.count
    counted = (f"the row's {pads} padding keys before its first real one" if pads and ahead == pads else
               f"{ahead} tokens more than the {before.count} keys its last query saw" if ahead > 0 else
               f"{-ahead} tokens fewer than the {before.count} keys its last query saw")
    return (f"the previous step's positions count {counted}, this step's "
            f"{'do not' if position == before.count else 'count otherwise'}: the two steps number the row's tokens "
            "on two scales (positions taken from the cache's slots at one step and from the attention mask at the other?)")


def extra_keys(short: int, pads: int) -> str:
    """The cause said where a query sees `short` keys more than its position counts (positioned.py's every-earlier-
    query-counted reading): as many as its row's left padding, that padding taken off twice; else keys left behind."""
    if pads and short == pads:
        return (f"it sits {short} places short, as many as the row's {pads} padding keys (the left padding subtracted "
                "twice: an offset applied to positions counted past it?)")
    return "keys of tokens no longer in the sequence stay in the cache (rejected draft tokens not rolled back?)"
