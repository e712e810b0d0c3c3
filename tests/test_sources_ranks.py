"""sources/ranks.py: each context-parallel rank's part of the global mask under a layout, checked against a double
loop over absolute positions built here from the layout's own fields (each piece's rank, start and size)."""

from __future__ import annotations

import numpy as np
import pytest

from maskcli.errors import MaskError
from maskcli.mask import build
from maskcli.shard import layouts
from maskcli.sources import ranks, registry


def rank_rows(layout, r: int) -> list[list[int]]:
    """Rank r's runs of real positions, in its local order, read off the layout's pieces by a loop."""
    return [list(range(s, s + n)) for k, s, n in zip(layout.rank.tolist(), layout.start.tolist(), layout.size.tolist())
            if k == r and s >= 0]


def keep(q: int, k: int) -> bool:
    """causal & window(4) at absolute positions."""
    return q - 4 < k <= q


@pytest.mark.parametrize("make", [lambda: layouts.contiguous(13, 3), lambda: layouts.headtail(13, 3),
                                  lambda: layouts.striped(13, 3, 2), lambda: layouts.per_document(np.array([5, 8]), 2)])
def test_each_rank_holds_the_global_mask_at_its_positions(make):
    layout = make()
    length = layout.length
    parts = registry.sources()["ranks"].load(layout, build("causal & window(4)", length=length))
    assert len(parts) == layout.ranks
    seen = []
    for r, runs in enumerate(parts):
        want_rows = rank_rows(layout, r)
        assert [list(range(m.frame.q_start, m.frame.q_end)) for m in runs] == want_rows
        for mask, rows in zip(runs, want_rows):
            want = np.array([[keep(q, k) for k in range(length)] for q in rows])
            assert np.array_equal(mask.dense()[0, 0], want), (r, rows)
        seen += [q for rows in want_rows for q in rows]
    assert sorted(seen) == list(range(length))  # every real position on one rank


def test_a_mask_of_another_length_is_refused():
    with pytest.raises(MaskError, match=r"splits 12 positions .*queries are 0..9.*\(--len 12\)"):
        ranks.load(layouts.contiguous(12, 2), build("causal", length=10))
