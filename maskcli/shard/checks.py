"""Rules that say a context-parallel split is wrong or imbalanced: each a small function returning findings.

A finding names its rule (code), how sure it is (wrong: the ranks compute another mask than the global one;
suspicious: valid but costly; note), the rank, and the first wrong cell on global positions, so that the
rules can join a common registry of checks later without change.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maskcli.shard.layouts import Layout
from maskcli.shard.work import Split

IMBALANCE = 1.25  # max/mean past this is worth a look: the slowest rank takes a quarter longer than the mean


@dataclass(frozen=True)
class Finding:
    """One claim about a split: code, severity (wrong | suspicious | note), message, rank, first wrong cell."""

    code: str
    severity: str
    message: str
    rank: int | None = None
    cell: tuple[int, int] | None = None  # (query, key), global positions

    def json(self) -> dict:
        return {"code": self.code, "severity": self.severity, "message": self.message, "rank": self.rank,
                "cell": list(self.cell) if self.cell is not None else None}


def coverage(layout: Layout) -> list[Finding]:
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
            "shard-dropped-token", "wrong",
            f"{missing.size:,} real token{'s' if missing.size > 1 else ''} on no rank, the first at position {first}{tail}: "
            f"its query row is never computed and no rank sees it as a key", None, (first, first)))
    twice = np.flatnonzero(times > 1)
    if twice.size:
        first = int(twice[0])
        held_by = [int(r) for r in rank[(start <= first) & (start + size > first)]]
        holders = sorted(set(held_by))
        who = (f"ranks {', '.join(map(str, holders))}" if len(holders) > 1
               else f"{len(held_by)} times by rank {holders[0]}")  # a rank's index list that repeats a token
        found.append(Finding(
            "shard-duplicate-token", "wrong",
            f"{twice.size:,} token{'s' if twice.size > 1 else ''} held more than once, the first at position {first} "
            f"({who}): its row is computed twice and its key seen twice", holders[0], (first, first)))
    return found


def padding(layout: Layout) -> list[Finding]:
    """Padding slots the layout added (a sequence or document padded to a multiple of 2 x ranks), in words."""
    pads = int(layout.size[~layout.real].sum())
    if not pads:
        return []
    return [Finding("shard-padding", "note",
                    f"{pads:,} padding slot{'s' if pads > 1 else ''} added ({layout.note}); they hold no real token, and no real query may see them")]


def uneven(layout: Layout) -> list[Finding]:
    """Ranks holding different numbers of slots: ring attention passes key/value buffers of one shape from rank
    to rank (PyTorch's _templated_ring_attention reshapes what arrives to its own key's shape, _context_parallel/_attention.py:433)."""
    slots = layout.slots()
    if slots.min() == slots.max():
        return []
    big, small = int(slots.argmax()), int(slots.argmin())
    return [Finding("shard-uneven", "suspicious",
                    f"rank {big} holds {slots[big]:,} slots and rank {small} {slots[small]:,}: ring attention passes equal-size "
                    f"key/value buffers between ranks; pad every rank to {slots[big]:,}", big)]


def imbalance(split: Split, limit: float = IMBALANCE, label: str = "") -> list[Finding]:
    """The slowest rank's work against the mean, where it is past `limit`."""
    ratios = split.ratios()
    worst = int(ratios.argmax())
    if ratios[worst] <= limit:
        return []
    least = int(ratios.argmin())
    where = f"{label}: " if label else ""
    return [Finding(
        "shard-imbalance", "suspicious",
        f"{where}rank {worst} does {ratios[worst]:.3f}x the mean work and rank {least} {ratios[least]:.3f}x under "
        f"--layout {split.layout.name}: every step waits for rank {worst}", worst)]


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
            "shard-local-indices", "wrong",
            f"rank {r}'s mask uses local indices: its row {i} is position {q}, but it masks as if it were position {i} "
            f"(first at query {q}, key {k}): map local rows and keys through the layout's indices, as PyTorch's "
            f"_create_cp_block_mask does", r, (q, k))]
    if causal_cells is not None and np.array_equal(rank_cells[real_rows], causal_cells[real_rows]):
        return [Finding(
            "shard-is-causal", "wrong",
            f"rank {r}'s part is plain causal, not {text} (first at query {q}, key {k}): is_causal=True replaced the "
            f"mask under context parallelism (PyTorch's ring attention takes only is_causal); give each rank its part of the mask", r, (q, k))]
    if k < 0:
        return [Finding("shard-padding-seen", "wrong",
                        f"rank {r}'s query {q} sees a padding slot (column {j}): padding must stay hidden from real queries", r, (q, k))]
    if global_cells[i, j]:
        # the tail: keys k.. to the last real position are hidden from every row of the rank (padding or truncation cut them)
        real_keys = keys >= 0
        last = int(keys[real_keys].max())
        cut = real_keys & (keys >= k)
        tail = not (rank_cells[real_rows][:, cut]).any() and (global_cells[real_rows][:, cut]).any(axis=0).all()
        return [Finding("shard-dropped-key", "wrong",
                        f"rank {r}'s part hides key {k} from query {q}, which {text} lets it see"
                        + (f" (and every key from {k} to {last}, the last: padding or truncation cut the tail)" if tail else ""),
                        r, (q, k))]
    return [Finding("shard-extra-key", "wrong", f"rank {r}'s part lets query {q} see key {k}, which {text} hides", r, (q, k))]


def wrong(findings: list[Finding]) -> bool:
    return any(f.severity == "wrong" for f in findings)
