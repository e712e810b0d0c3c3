"""Rules that say a sequence split across context-parallel ranks is wrong or imbalanced (maskcli shard).

Each reads the split (`ranks`): a layout (maskcli.shard.layouts.Layout: which rank holds which positions, as runs),
a mask's work under it (shard.work.Split), or each rank's captured part. They take those objects as they come and
import nothing of shard/ (this package sits below it). Their severity is their rule's: wrong where the ranks
compute another mask than the global one, suspicious where the split is valid but costly, a note for padding. A
finding names the rank it is about (None: the split as a whole) and its cell is (query, key) on global positions, the
one sequence a split has no batch row.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.registry import Rule
from maskcli.text import Finding

IMBALANCE = 1.25  # max/mean past this is worth a look: the slowest rank takes a quarter longer than the mean


def coverage(layout) -> list[Finding]:
    """Every real token on exactly one rank: else the ranks' parts do not add up to the global mask (a token on no
    rank is a query row nobody computes and a key nobody sees; on two ranks, computed twice)."""
    real = layout.real
    start, size, rank = layout.start[real], layout.size[real], layout.rank[real]
    held = np.zeros(layout.length + 1, dtype=np.int64)  # a difference array over the pieces: O(pieces + L), numpy
    np.add.at(held, start, 1)
    np.add.at(held, start + size, -1)
    times = np.cumsum(held)[:-1]
    found = []
    missing = np.flatnonzero(times == 0)
    if missing.size:
        first = int(missing[0])
        tail = " (the tail: padding or truncation to a multiple of the ranks cut real tokens)" if missing[-1] == layout.length - 1 else ""
        found.append(Finding(
            "shard-dropped-token",
            f"{missing.size:,} real token{'s' if missing.size > 1 else ''} on no rank, the first at position {first}{tail}: "
            f"its query row is never computed and no rank sees it as a key", cell=(first, first)))
    twice = np.flatnonzero(times > 1)
    if twice.size:
        first = int(twice[0])
        held_by = [int(r) for r in rank[(start <= first) & (start + size > first)]]
        holders = sorted(set(held_by))
        who = (f"ranks {', '.join(map(str, holders))}" if len(holders) > 1
               else f"{len(held_by)} times by rank {holders[0]}")  # a rank's index list that repeats a token
        found.append(Finding(
            "shard-duplicate-token",
            f"{twice.size:,} token{'s' if twice.size > 1 else ''} held more than once, the first at position {first} "
            f"({who}): its row is computed twice and its key seen twice", cell=(first, first), rank=holders[0]))
    return found


def padding(layout) -> list[Finding]:
    """Padding slots the layout added (a sequence or document padded to a multiple of 2 x ranks), in words."""
    pads = int(layout.size[~layout.real].sum())
    if not pads:
        return []
    return [Finding("shard-padding",
                        f"{pads:,} padding slot{'s' if pads > 1 else ''} added ({layout.note}); they hold no real token, and no real query may see them")]


def uneven(layout) -> list[Finding]:
    """Ranks holding different numbers of slots: ring attention passes key/value buffers of one shape from rank
    to rank (PyTorch's _templated_ring_attention reshapes what arrives to its own key's shape, _context_parallel/_attention.py:433)."""
    slots = layout.slots()
    if slots.min() == slots.max():
        return []
    big, small = int(slots.argmax()), int(slots.argmin())
    return [Finding("shard-uneven",
                        f"rank {big} holds {slots[big]:,} slots and rank {small} {slots[small]:,}: ring attention passes equal-size "
                        f"key/value buffers between ranks; pad every rank to {slots[big]:,}", rank=big)]


def imbalance(split, limit: float = IMBALANCE, label: str = "") -> list[Finding]:
    """The slowest rank's work against the mean, where it is past `limit`."""
    ratios = split.ratios()
    worst = int(ratios.argmax())
    if ratios[worst] <= limit:
        return []
    least = int(ratios.argmin())
    where = f"{label}: " if label else ""
    return [Finding(
        "shard-imbalance",
        f"{where}rank {worst} does {ratios[worst]:.3f}x the mean work and rank {least} {ratios[least]:.3f}x under "
        f"--layout {split.layout.name}: every step waits for rank {worst}", rank=worst)]


def rank_part(global_cells: np.ndarray, rank_cells: np.ndarray, rows: np.ndarray, keys: np.ndarray, r: int,
              text: str, local_cells: np.ndarray | None, causal_cells: np.ndarray | None) -> list[Finding]:
    """Rank r's mask (its slots x every slot in the gathered order) against the global mask on the positions
    `rows` and `keys` hold (-1: padding, never visible to a real query).

    `local_cells`: the global mask read on local indices (row i as position i), and `causal_cells`: plain causal
    on global positions, the two mistakes named where the rank's cells equal them exactly."""
    real_rows = rows >= 0
    differ = (rank_cells != global_cells) & real_rows[:, None]
    if not differ.any():
        return []
    i, j = (int(v) for v in np.argwhere(differ)[0])
    q, k = int(rows[i]), int(keys[j])
    if local_cells is not None and np.array_equal(rank_cells[real_rows], local_cells[real_rows]):
        return [Finding(
            "shard-local-indices",
            f"rank {r}'s mask uses local indices: its row {i} is position {q}, but it masks as if it were position {i} "
            f"(first at query {q}, key {k}): map local rows and keys through the layout's indices, as PyTorch's "
            f"_create_cp_block_mask does", cell=(q, k), rank=r)]
    if causal_cells is not None and np.array_equal(rank_cells[real_rows], causal_cells[real_rows]):
        return [Finding(
            "shard-is-causal",
            f"rank {r}'s part is plain causal, not {text} (first at query {q}, key {k}): is_causal=True replaced the "
            f"mask under context parallelism (PyTorch's ring attention takes only is_causal); give each rank its part of the mask", cell=(q, k), rank=r)]
    if k < 0:
        return [Finding("shard-padding-seen",
                            f"rank {r}'s query {q} sees a padding slot (column {j}): padding must stay hidden from real queries", cell=(q, k), rank=r)]
    if global_cells[i, j]:
        # the tail: keys k.. to the last real position are hidden from every row of the rank (padding or truncation cut them)
        real_keys = keys >= 0
        last = int(keys[real_keys].max())
        cut = real_keys & (keys >= k)
        tail = not (rank_cells[real_rows][:, cut]).any() and (global_cells[real_rows][:, cut]).any(axis=0).all()
        return [Finding("shard-dropped-key",
                            f"rank {r}'s part hides key {k} from query {q}, which {text} lets it see"
                            + (f" (and every key from {k} to {last}, the last: padding or truncation cut the tail)" if tail else ""),
                            cell=(q, k), rank=r)]
    return [Finding("shard-extra-key", f"rank {r}'s part lets query {q} see key {k}, which {text} hides", cell=(q, k), rank=r)]


RULES = (
    Rule("shard-dropped-token", "wrong", "ranks", "real tokens on no rank (padding or truncation to a multiple of the "
         "ranks cut them): rows nobody computes, keys nobody sees", coverage, given="layout"),
    Rule("shard-duplicate-token", "wrong", "ranks", "a token held by two ranks, or twice by one: its row computed and "
         "its key seen twice", coverage, given="layout"),
    Rule("shard-uneven", "suspicious", "ranks", "ranks holding different numbers of slots, where ring attention passes "
         "equal-size key/value buffers", uneven, given="layout"),  # (before padding: registry.run says a layout's findings in this order)
    Rule("shard-padding", "note", "ranks", "padding slots a layout adds to make equal chunks (a multiple of 2 x ranks)",
         padding, given="layout"),
    Rule("shard-imbalance", "suspicious", "ranks", "a valid split where the slowest rank does more than 1.25x the mean "
         "work, so every step waits for it", imbalance, given="split"),
    Rule("shard-local-indices", "wrong", "ranks", "a rank's mask built on local indices, not the global positions its "
         "rows and keys hold", rank_part, given="part"),
    Rule("shard-is-causal", "wrong", "ranks", "a rank's part plain causal where the layer's mask is not: is_causal=True "
         "replaced a window or chunks under context parallelism", rank_part, given="part"),
    Rule("shard-padding-seen", "wrong", "ranks", "a real query of a rank's part that sees a padding slot", rank_part, given="part"),
    Rule("shard-dropped-key", "wrong", "ranks", "a rank's part that hides a key the global mask lets its query see (a "
         "cut tail named as such)", rank_part, given="part"),
    Rule("shard-extra-key", "wrong", "ranks", "a rank's part that lets a query see a key the global mask hides",
         rank_part, given="part"),
)
