"""A traced context-parallel run read back as each rank's part of the mask: `maskcli shard EXPR --trace run.pt`.

The trace is one `maskcli trace --save` of a job under torchrun (every rank's calls, each with its rank). A call
site (a module, or a function's line) that every rank called is read in one of the two ways projects attend over
a sequence split across ranks, told apart by its shapes under the layout:

    all-gather  one call a pass: the rank's slots x every slot in the gathered order (each rank's slots in
                turn), the part as it is (PyTorch's convention, shard/ranks.py);
    ring        N calls a pass, call i on the keys of rank (r - i) mod N (the keys passed round the ring, as
                shard's ring steps number them): the N blocks put side by side in the gathered order.

Each pass gives every rank's part; passes and sites whose parts are the same are checked once. What ran is then
measured off the parts (each rank's cells, each ring step's), not computed from the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maskcli.errors import MaskError
from maskcli.shard.layouts import Layout
from maskcli.text import spans


@dataclass
class Traced:
    label: str  # the sites and passes these parts were read at, in words
    parts: list  # bool (rank's slots, every slot) per rank


def ranks_of(path: str) -> int:
    """How many ranks the trace holds; a trace of one process is refused in one line."""
    from maskcli.tracefile import load

    data = load(path)
    if "ranks" not in data:
        raise MaskError(f"--trace {path!r} is the trace of one process: trace the job under its launcher, like "
                        f"torchrun --nproc-per-node 2 -m maskcli trace --save {path} train.py")
    return len(data["ranks"])


def length_of(path: str) -> int | None:
    """The sequence's length as the run split it: the query rows of the first call site every rank called, added up
    over the ranks, where its keys are that many (all-gather) or its own rows (ring); None where no site is."""
    from maskcli.tracefile import load

    data = load(path)
    n = ranks_of(path)
    firsts: dict[str, dict[int, dict]] = {}
    for call in data["calls"]:
        firsts.setdefault(call["where"], {}).setdefault(call["rank"], call)
    for by_rank in firsts.values():
        if len(by_rank) == n:
            rows = sum(int(call["shape"][2]) for call in by_rank.values())
            if all(int(call["shape"][3]) in (rows, int(call["shape"][2])) for call in by_rank.values()):
                return rows
    return None


def read(path: str, layout: Layout) -> tuple[list[Traced], list[str]]:
    """(each distinct set of parts, with where it was read; the sites left out, each in words)."""
    from maskcli.tracefile import dense, load

    data = load(path)
    n = ranks_of(path)
    if n != layout.ranks:
        raise MaskError(f"--trace {path!r} holds {n} ranks but --ranks is {layout.ranks}: give --ranks {n}, or leave it out")
    if layout.heads is not None:
        raise MaskError(f"--layout {layout.name} splits heads, not tokens: --trace reads each rank's part of the tokens "
                        "(all_gather or ring); give the token layout the run used")
    slots = layout.slots()
    offsets = np.concatenate([[0], np.cumsum(slots)])
    total = int(offsets[-1])
    sites: dict[str, dict[int, list]] = {}
    for call in data["calls"]:
        if call.get("mask") is not None:
            sites.setdefault(call["where"], {}).setdefault(call["rank"], []).append(call)
    found: dict[bytes, Traced] = {}
    read_at: dict[bytes, list] = {}
    left: list[str] = []
    for where, by_rank in sites.items():
        if sorted(by_rank) != list(range(n)):
            left.append(f"{where or 'a call'}: made on rank {spans(sorted(by_rank))} only, not on every rank")
            continue
        passes, why = _passes(by_rank, slots, total, n)
        if passes is None:
            left.append(f"{where or 'a call'}: {why}")
            continue
        for number, calls in enumerate(passes):
            parts = []
            for r in range(n):
                part = np.zeros((int(slots[r]), total), dtype=bool)
                for i, call in enumerate(calls[r]):
                    keep = _one_plane(dense(data["masks"][call["mask"]]), call, path)
                    if keep.shape[1] == total:
                        part = keep
                    else:
                        s = (r - i) % n
                        part[:, offsets[s]:offsets[s + 1]] = keep
                parts.append(part)
            key = b"".join(np.packbits(p).tobytes() + bytes(str(p.shape), "ascii") for p in parts)
            found.setdefault(key, Traced("", parts))
            read_at.setdefault(key, []).append((where, number))
    if not found:
        raise MaskError(f"--trace {path!r}: no call site every rank called with its part under --layout {layout.name} "
                        f"(its slots x all {total:,}, or a ring's slots x each rank's): " + "; ".join(left[:3]))
    for key, traced in found.items():
        places: dict[str, list[int]] = {}
        for where, number in read_at[key]:
            places.setdefault(where, []).append(number)
        traced.label = ", ".join(f"{where or 'a call'} (pass{'es' if len(numbers) > 1 else ''} {spans(numbers)})"
                                 for where, numbers in places.items())
    return list(found.values()), left


def _passes(by_rank: dict[int, list], slots: np.ndarray, total: int, n: int) -> tuple[list | None, str]:
    """The site's calls cut into passes ([pass][rank] -> calls), or None and why they are no rank's part."""
    ring = all(int(c["shape"][3]) != total for calls in by_rank.values() for c in calls)
    counts = {len(calls) for calls in by_rank.values()}
    if len(counts) > 1:
        return None, f"the ranks made {', '.join(map(str, sorted(counts)))} calls there: not the same passes"
    count = counts.pop()
    for r, calls in by_rank.items():
        for i, call in enumerate(calls):
            q_len, k_len = int(call["shape"][2]), int(call["shape"][3])
            want = total if not ring else int(slots[(r - i) % n])
            if q_len != slots[r] or k_len != want:
                return None, (f"rank {r}'s call {call['rank_index']} is {q_len} x {k_len}, not rank {r}'s {int(slots[r])} slots x "
                              f"{'all ' if not ring else 'rank ' + str((r - i) % n) + chr(39) + 's '}{want}")
    step = n if ring else 1
    if count % step:
        return None, f"{count} calls a rank is not a whole number of ring passes of {n} steps"
    return [[by_rank[r][p * step:(p + 1) * step] for r in range(n)] for p in range(count // step)], ""


def _one_plane(keep: np.ndarray, call: dict, path: str) -> np.ndarray:
    """The one (Lq, Lk) plane a context-parallel call's mask is (every batch row and head the same)."""
    flat = keep.reshape(-1, *keep.shape[2:])
    if not (flat == flat[:1]).all():
        raise MaskError(f"--trace {path!r}: rank {call['rank']}'s call {call['rank_index']} ({call['where']}) has batch rows "
                        "or heads with different masks: a context-parallel part is one sequence's")
    return flat[0]


def measured(mask, layout: Layout, parts: list[np.ndarray], head_dim: int):
    """The Split of what ran: each rank's visible cells and each ring step's, counted off its part (real rows and
    keys only), as shard.work.split computes them from the layout."""
    from maskcli.shard.work import Split

    n = layout.ranks
    owner = np.concatenate([np.full(int(size), r) for r, size in enumerate(layout.slots())])
    real_keys = layout.indices() < layout.length
    cells = np.zeros(n, dtype=np.int64)
    grid = np.zeros((n, n), dtype=np.int64)
    for r, part in enumerate(parts):
        rows = part[layout.rank_indices(r) >= 0][:, real_keys]
        per_key = rows.sum(axis=0)
        grid[r] = np.bincount(owner[real_keys], weights=per_key, minlength=n).astype(np.int64)
        cells[r] = int(grid[r].sum())
    return Split(mask, layout, cells, grid, head_dim)
