"""Kinds read from a label per position: chunk, document, segment, blocks.

Labels cover the whole sequence 0..n-1 and are indexed by absolute position; one row is
shared by every batch row, or there is one row per batch row.
"""

from __future__ import annotations

import numpy as np

from maskcli.intervals import MAX_PER_ROW, Intervals, NotFew
from maskcli.kinds.base import Kind, Param, Profile
from maskcli.kinds.values import Labels, inline, row_of


def _labels_param(help_text: str) -> Param:
    return Param("labels", "labels", help_text, "--chunks", metavar="LABELS", sizes=True)


def same_label(labels: np.ndarray, frame, what: str, skip_negative: bool = False) -> Intervals:
    """Per (batch row, query): the runs of keys that carry the query's label, as intervals.

    The runs of each label are found once and gathered per query, so the work is O(n) per batch row,
    over every row at once, whatever the length; a label that comes back in more than MAX_PER_ROW runs is NotFew.
    `skip_negative` leaves out labels below 0 (block ids' -1, "no block"): their queries get no
    interval here, however often they come back.
    """
    q = frame.q_positions
    rows, n = labels.shape
    flat = labels.reshape(-1)
    # runs over every batch row at once (a row's first position always starts a run): 1M rows are one pass
    new_run = np.ones(flat.shape, dtype=bool)
    new_run[1:] = flat[1:] != flat[:-1]
    new_run[::n] = True
    run_start = np.flatnonzero(new_run)
    run_end = np.append(run_start[1:], flat.size)
    run_row, run_label = run_start // n, flat[run_start]
    # a group is one label in one batch row; groups are numbered in (row, label) order
    order = np.lexsort((run_label, run_row))
    first_of_group = np.ones(len(order), dtype=bool)
    first_of_group[1:] = (run_row[order][1:] != run_row[order][:-1]) | (run_label[order][1:] != run_label[order][:-1])
    group = np.empty(len(order), dtype=np.int64)
    group[order] = np.cumsum(first_of_group) - 1
    n_groups = int(first_of_group.sum())
    kept = run_label >= 0 if skip_negative else np.ones(len(run_start), dtype=bool)
    counts = np.bincount(group[kept], minlength=n_groups)
    if counts.max(initial=0) > MAX_PER_ROW:
        worst = np.flatnonzero(kept & (group == counts.argmax()))[0]
        raise NotFew(f"{what}: label {int(run_label[worst])} comes back in {int(counts.max())} separate runs")
    ranked = np.flatnonzero(kept)[np.argsort(group[kept], kind="stable")]  # kept runs grouped, in position order
    rank = np.arange(len(ranked)) - np.repeat(np.cumsum(counts) - counts, counts)
    width = max(int(counts.max(initial=0)), 1)
    table_s = np.full((n_groups, width), frame.k_end, dtype=np.int64)
    table_e = np.full((n_groups, width), frame.k_end, dtype=np.int64)
    local = run_start - run_row * n
    table_s[group[ranked], rank] = local[ranked]
    table_e[group[ranked], rank] = local[ranked] + (run_end - run_start)[ranked]
    group_at = np.repeat(group, run_end - run_start).reshape(rows, n)[:, q]  # (R, Lq): each query's group
    starts, ends = table_s[group_at], table_e[group_at]
    return Intervals.of(starts, ends, frame.k_start, frame.k_end)


def run_starts(labels: np.ndarray) -> np.ndarray:
    """int64 (R, n): where each position's run of equal labels starts (a document of packed sequences)."""
    rows, n = labels.shape
    new_run = np.ones(labels.shape, dtype=bool)
    new_run[:, 1:] = labels[:, 1:] != labels[:, :-1]
    return np.maximum.accumulate(np.where(new_run, np.arange(n, dtype=np.int64), 0), axis=1)


def run_start(row: np.ndarray, i: int) -> int:
    """Where the run of equal labels that holds position i starts (one row): read back in doubling steps, so the
    work is the run's length, not the sequence's."""
    step, end = 64, i
    while end > 0:
        begin = max(0, end - step)
        other = np.flatnonzero(row[begin:end] != row[i])
        if len(other):
            return begin + int(other[-1]) + 1
        end, step = begin, 2 * step
    return 0


def _labels_at(p, b, q, kv) -> tuple[int, int]:
    row = row_of(p["labels"].array, b)
    return int(row[q]), int(row[kv])


def _chunk_why(p, frame, b, q, kv):
    at_q, at_kv = _labels_at(p, b, q, kv)
    return (at_kv <= at_q), f"label {at_q} at q {q}, label {at_kv} at kv {kv}: {at_kv} {'<=' if at_kv <= at_q else '>'} {at_q}"


def _document_why(p, frame, b, q, kv):
    at_q, at_kv = _labels_at(p, b, q, kv)
    if at_q != at_kv:
        return False, f"label {at_q} at q {q}, label {at_kv} at kv {kv}: another document"
    return (kv <= q), f"label {at_q} at q {q} and kv {kv}, " + ("kv <= q" if kv <= q else "but kv > q: a later key")


def _segment_why(p, frame, b, q, kv):
    at_q, at_kv = _labels_at(p, b, q, kv)
    if at_q != at_kv:
        return False, f"label {at_q} at q {q}, label {at_kv} at kv {kv}: another segment"
    return True, f"label {at_q} at q {q} and kv {kv}: one segment, seen both ways"


def _blocks_why(p, frame, b, q, kv):
    at_q, at_kv = _labels_at(p, b, q, kv)
    if at_q < 0:
        return False, f"id {at_q} at q {q}: no block"
    if at_q != at_kv:
        return False, f"block {at_q} at q {q}, {'no block' if at_kv < 0 else f'block {at_kv}'} at kv {kv}"
    return True, f"block {at_q} at q {q} and kv {kv}: one block, seen both ways"


class LabelCounts:
    """Exact visible keys per query row of a same-label kind (document, segment, blocks), from running counts per label.

    Labels that come back in thousands of runs (document ids cycling through 7 values) have
    intervals that are not few, yet what a query sees before key position x is only how many
    keys of its label come before x (and before the query itself, where causal): a count per
    label kept as x grows. That is O(n log n) per batch row once, then O(Lq) per position
    asked, with no cells. `valid` is the key padding of --lengths/--ids (bool (V, n)) or None.
    """

    def __init__(self, labels: np.ndarray, frame, valid, causal: bool, skip_negative: bool = False):
        self.labels, self.frame, self.valid = labels, frame, valid
        self.causal, self.skip_negative = causal, skip_negative
        self._rows: dict[int, tuple] = {}

    def _row(self, b: int) -> tuple:
        if b not in self._rows:
            f = self.frame
            labels = self.labels[b if self.labels.shape[0] > 1 else 0]
            weight = np.zeros(labels.shape[0], dtype=np.int64)  # 1 for a key that counts: in the keys, and real
            weight[f.k_start : f.k_end] = 1
            if self.valid is not None:
                weight &= self.valid[b if self.valid.shape[0] > 1 else 0]
            groups, group = np.unique(labels, return_inverse=True)
            q = f.q_positions
            through = None
            if self.causal:  # keys of its label at or before each position, by a running sum within each label
                order = np.argsort(group, kind="stable")
                running = np.cumsum(weight[order])
                first = np.r_[True, group[order][1:] != group[order][:-1]]
                before = (running - weight[order])[first]
                within = np.empty_like(running)
                within[order] = running - before[group[order]]
                through = within[q]
            seen = labels[q] >= 0 if self.skip_negative else None
            self._rows[b] = (group, weight, group[q], through, seen, len(groups))
        return self._rows[b]

    def keys_below(self, b: int, positions):
        """For ascending key positions, yield int64 (Lq,): per query row of batch row b, its visible keys before each."""
        group, weight, group_q, through, seen, count = self._row(b)
        q = self.frame.q_positions
        so_far = np.zeros(count, dtype=np.int64)  # per label: the keys that count before `done`
        done = 0
        for x in positions:
            x = int(min(max(x, 0), len(group)))
            np.add.at(so_far, group[done:x], weight[done:x])
            done = max(done, x)
            out = so_far[group_q]
            if through is not None:  # a query before x sees its label's keys up to itself only
                out = np.where(q < x, through, out)
            if seen is not None:
                out = np.where(seen, out, 0)
            yield out


def _segment_intervals(p, frame):
    return same_label(p["labels"].array, frame, "segment labels")


def _document_intervals(p, frame):
    causal = Intervals.of(frame.k_start, frame.q_column + 1, frame.k_start, frame.k_end)
    return same_label(p["labels"].array, frame, "document labels") & causal


def _blocks_intervals(p, frame):
    ids = p["labels"].array
    same = same_label(ids, frame, "block ids", skip_negative=True)
    in_block = (ids[:, frame.q_start : frame.q_end] >= 0)[:, :, None]  # (R, Lq, 1): -1 is no block
    return Intervals.of(np.where(in_block, same.starts, frame.k_end), np.where(in_block, same.ends, frame.k_end), frame.k_start, frame.k_end)


def _chunk_intervals(p, frame):
    labels = p["labels"].array
    down = labels[:, 1:] < labels[:, :-1]
    if down.any():
        row, position = (int(i) for i in np.argwhere(down)[0])
        raise NotFew(f"chunk labels go down at position {position + 1} ({labels[row, position]} then {labels[row, position + 1]})")
    q = frame.q_positions
    # labels that never go down: the keys whose label is at most the query's are one prefix
    ends = np.stack([np.searchsorted(row, row[q], side="right") for row in labels])
    return np.int64(0), ends[:, :, None]


def position_table(array: np.ndarray, device):
    """A (R, n) table of values per position on the device; one row is shared by every batch row."""
    import torch

    table = torch.as_tensor(array, device=device)
    return table[0] if table.shape[0] == 1 else table


def _label_table(p, device):
    return position_table(p["labels"].array, device)


def at_position(table, b, index):
    """The table's value at each index (of batch row b where it has a row per batch row)."""
    # clamped: a FlexAttention kernel may call a mask_mod on the padding past the last block's end
    index = index.clamp(0, table.shape[-1] - 1)
    return table[index] if table.dim() == 1 else table[b, index]


def _chunk_predicate(p, frame, device):
    labels = _label_table(p, device)

    def chunk(b, h, q_idx, kv_idx):
        return at_position(labels, b, kv_idx) <= at_position(labels, b, q_idx)

    return chunk


def _document_predicate(p, frame, device):
    labels = _label_table(p, device)

    def document(b, h, q_idx, kv_idx):
        return (at_position(labels, b, kv_idx) == at_position(labels, b, q_idx)) & (kv_idx <= q_idx)

    return document


def _segment_predicate(p, frame, device):
    labels = _label_table(p, device)

    def segment(b, h, q_idx, kv_idx):
        return at_position(labels, b, kv_idx) == at_position(labels, b, q_idx)

    return segment


def _blocks_predicate(p, frame, device):
    ids = _label_table(p, device)

    def blocks(b, h, q_idx, kv_idx):
        block = at_position(ids, b, q_idx)
        return (at_position(ids, b, kv_idx) == block) & (block >= 0)

    return blocks


def _chunk_check(p, frame, where):
    if p["labels"].form == "sizes":  # 0,0,1,1,2,...: never down (and not built before the mask's memory guard)
        return []
    labels = p["labels"].array
    down = labels[:, 1:] < labels[:, :-1]
    if down.any():
        row, position = (int(i) for i in np.argwhere(down)[0])
        return [
            f"{where}: chunk labels go down at position {position + 1} ({labels[row, position]} then "
            f"{labels[row, position + 1]}): label[kv] <= label[q] then lets earlier tokens see later ones"
        ]
    return []


def _from_starts(new: np.ndarray) -> Labels:
    """Labels 0,0,1,1,2 from a bool per position saying where a new label starts."""
    new = new.copy()
    new[0] = False
    return inline([np.cumsum(new).tolist()], "recognised labels")


def _whole_sequence(profile: Profile) -> bool:
    """Label kinds are read off a mask whose queries and keys are both the whole sequence 0..n-1."""
    return profile.k_start == 0 and len(profile.q) == profile.k_end and profile.q[0] == 0


def _chunk_candidates(profile: Profile):
    # a chunk mask's rows all see from key 0 (or, with key padding, from the same first real key): else no candidate
    if _whole_sequence(profile) and profile.seen.all() and (profile.first == profile.first[0]).all():
        labels = _from_starts(np.r_[False, profile.last[1:] != profile.last[:-1]])
        sizes = np.bincount(labels.array[0])
        if (sizes == 1).sum() > len(sizes) / 2 and sizes.max() > 1:
            return  # mostly single tokens with a few runs: causal text with blocks, which inspect names as such
        yield {"labels": labels}


def _document_candidates(profile: Profile):
    if _whole_sequence(profile) and profile.seen.all():
        new = np.r_[False, profile.first[1:] != profile.first[:-1]]
        if _own_groups(profile, new):
            yield {"labels": _from_starts(new)}


def _own_groups(profile: Profile, new: np.ndarray) -> bool:
    """Whether no row sees a key before its group (rows from one `new` start to the next) begins: a row of a
    document, segment or block sees only its group's keys (key padding only takes some away), so labels read off a
    tensor whose rows see earlier keys (a window's) are no candidate, and are not made."""
    starts = np.flatnonzero(np.r_[True, new[1:]])
    return bool((profile.first[starts] >= starts).all())


def _blocks_candidates(profile: Profile):
    if _whole_sequence(profile) and profile.seen.any():
        block = np.r_[False, profile.first[1:] != profile.first[:-1]]
        if not _own_groups(profile, block):
            return
        ids = np.cumsum(block)
        ids[~profile.seen] = -1
        yield {"labels": inline([ids.tolist()], "recognised ids")}


def _sequence(p) -> int:
    return p["labels"].length


KINDS = (
    Kind(
        name="chunk",
        meaning="a token sees its own chunk and every earlier chunk (the chunk labels of the classic tutorial)",
        keep="label[kv] <= label[q]",
        params=(_labels_param("one integer label per position, like 0,0,1,1 (';' between batch rows), or a .npy/.json/.txt/.pt file"),),
        example="chunk(0,0,1,1,2)",
        intervals=_chunk_intervals,
        predicate=_chunk_predicate,
        why=_chunk_why,
        rank=10,
        recognise=_chunk_candidates,
        check=_chunk_check,
        sequence=_sequence,
        sees_own=True,
    ),
    Kind(
        name="document",
        meaning="packed sequences: causal inside each document, nothing across documents",
        keep="label[kv] == label[q] and kv <= q",
        params=(_labels_param("a document label per position"),),
        example="document(0,0,0,1,1)",
        intervals=_document_intervals,
        predicate=_document_predicate,
        counts=lambda p, frame, valid: LabelCounts(p["labels"].array, frame, valid, causal=True),
        why=_document_why,
        rank=11,
        recognise=_document_candidates,
        sequence=_sequence,
        documents=True,
        causal=True,
        sees_own=True,
    ),
    Kind(
        name="segment",
        meaning="bidirectional inside each segment, nothing across segments (packed encoder inputs)",
        keep="label[kv] == label[q]",
        params=(_labels_param("a segment label per position"),),
        example="segment(0,0,1,1)",
        intervals=_segment_intervals,
        predicate=_segment_predicate,
        counts=lambda p, frame, valid: LabelCounts(p["labels"].array, frame, valid, causal=False),
        why=_segment_why,
        rank=12,
        recognise=_document_candidates,
        sequence=_sequence,
        documents=True,
        sees_own=True,
    ),
    Kind(
        name="blocks",
        meaning="tokens that share a block id >= 0 see each other both ways; -1 is no block (Gemma 3 image tokens: causal | blocks(...))",
        keep="ids[q] == ids[kv] >= 0",
        params=(Param("labels", "labels", "a block id per position, -1 outside every block", "--block-ids", metavar="IDS"),),
        example="causal | blocks(-1,-1,0,0,0,-1)",
        intervals=_blocks_intervals,
        predicate=_blocks_predicate,
        counts=lambda p, frame, valid: LabelCounts(p["labels"].array, frame, valid, causal=False, skip_negative=True),
        why=_blocks_why,
        rank=13,
        recognise=_blocks_candidates,
        sequence=_sequence,
    ),
)
