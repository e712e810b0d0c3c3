"""A mask implied by a context-parallel rank layout (what `maskcli shard` splits): each rank's part of the global mask.

A layout (shard/layouts.py's Layout, taken as it comes: its `ranks`, and its pieces `rank`, `start`, `size` in each
rank's local order, start -1 for padding slots) says which runs of positions each rank holds. Rank r's part is the
global mask over those query positions, its keys every position (ring attention gathers them all): one Mask per run,
the global Mask's view over those rows (Mask.crop), exact at any length; padding slots hold no query. shard reads what
each rank should hold through it (shard/ranks.py lays the runs out in PyTorch's order, keys gathered, padding empty)
to check the parts a run captured (--rank-mask, --trace).
"""

from __future__ import annotations

from maskcli.errors import MaskError
from maskcli.mask import Mask
from maskcli.sources.base import Source


def load(layout, mask: Mask) -> list[list[Mask]]:
    """Per rank, in rank order, the global `mask` over each run of real positions the rank holds, in its local
    order (a contiguous split holds one run a rank, head-tail two, striped many)."""
    f = mask.frame
    if (f.q_start, f.q_len) != (0, layout.length):
        raise MaskError(f"the layout splits {layout.length:,} positions but the mask's queries are "
                        f"{f.q_start}..{f.q_end - 1}: give the mask of the whole sequence (--len {layout.length})")
    parts: list[list[Mask]] = [[] for _ in range(layout.ranks)]
    for rank, start, size in zip(layout.rank.tolist(), layout.start.tolist(), layout.size.tolist()):
        if start >= 0:  # a padding slot is no position of the sequence
            parts[rank].append(mask.crop((start, start + size)))
    return parts


SOURCE = Source("ranks", load)
