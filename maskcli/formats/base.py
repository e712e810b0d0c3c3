"""What a kernel format is, and the helpers every format shares: exact interval comparison, the column
(transposed) view of a mask, and a Mask made from intervals read back out of a format.

A format `to` a mask gives an `Export`: the Python call that applies the mask in that library,
written with `<name>` where a tensor goes, and those tensors (numpy), which `--save` writes.
A format that cannot hold a mask raises `CannotHold` with why and what would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from maskcli.errors import MaskError
from maskcli.intervals import Intervals
from maskcli.mask import Mask
from maskcli.positions import Frame

EVENTS_PER_POSITION = 16  # the column view gives up past this many (row, key) changes per position


class CannotHold(MaskError):
    """This format cannot express this mask; the message says why and what would."""


@dataclass(frozen=True)
class Export:
    """A mask in one library's format: the call (with `<name>` for each tensor) and the tensors."""

    code: list[str]
    tensors: dict[str, np.ndarray]
    notes: list[str] = field(default_factory=list)
    # where the kernel wants its tensors: "cuda", "cpu", or an input's device ("q.device"): the call then runs on
    # whatever device the user's tensors are on, as printed (SDPA refuses a mask on another device than q)
    device: str = "cuda"


@dataclass(frozen=True)
class Format:
    """One kernel format, defined once: `maskcli export --for`, `--from`, `--compare` and the docs read it."""

    name: str
    library: str
    holds: str  # what masks it can express, one line
    to: Callable[[Mask], Export]
    read: Callable[[dict, dict], Mask] | None = None  # (tensors, flags) -> Mask, for --mask FILE --from NAME
    aliases: tuple[str, ...] = ()
    dense: bool = False  # an L x L tensor is the format itself
    version: str = ""  # the library release whose signatures the printed call is written for (and checked against)


def heads_differ(mask: Mask) -> bool:
    """Whether a format that holds one mask for every head cannot hold this one: mask.heads_differ, read off the cells
    where a tensor's heads are given (a file whose heads are all the same holds one mask for every head, as `show` says
    of it: heads 0-2 identical)."""
    if not mask.heads_differ:
        return False
    keep = mask.keep
    return keep is None or not bool((keep == keep[:, :1]).all())


def plain_rows(mask: Mask, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(B, Lq, K) int64 starts and ends of a mask's intervals, broadcast; refused where they are not few."""
    if heads_differ(mask):
        raise CannotHold(f"{what} holds one mask for every head, and the heads of {mask.title} differ: use --for sdpa (a dense mask per head)")
    if mask.keep is not None:  # a tensor's cells: its runs of keys, read row by row (the tensor is L x L already)
        iv = cell_runs(mask)
    elif not mask.exact:
        raise CannotHold(f"{what} needs the mask's key intervals, and {mask.title} has none ({mask.why_not_exact}): use --for sdpa or flex")
    else:
        iv = mask.intervals()
    shape = (mask.batch, mask.frame.q_len, iv.per_row)
    return np.broadcast_to(iv.starts, shape), np.broadcast_to(iv.ends, shape)


def cell_runs(mask: Mask) -> Intervals:
    """The runs of visible keys of a tensor mask's rows, as intervals (B, Lq, K)."""
    keep = np.broadcast_to(mask.keep[:, 0], (mask.batch,) + mask.keep.shape[2:])
    f = mask.frame
    padded = np.pad(keep, ((0, 0), (0, 0), (1, 1)))
    step = np.diff(padded.view(np.int8), axis=-1)
    b, q, k = np.nonzero(step == 1)
    _, _, e = np.nonzero(step == -1)
    planes = [rows_of([(q[b == i], k[b == i] + f.k_start, e[b == i] + f.k_start)], f.q_len, f.k_start, f.k_end) for i in range(mask.batch)]
    width = max(p.per_row for p in planes)

    def pad(a):
        return np.concatenate([a, np.full(a.shape[:2] + (width - a.shape[2],), f.k_end, dtype=np.int64)], -1)

    return Intervals(np.concatenate([pad(p.starts) for p in planes]), np.concatenate([pad(p.ends) for p in planes]), f.k_start, f.k_end)


def same(a: Intervals, b: Intervals, batch: int, q_len: int) -> bool:
    """Whether two normalised interval sets are the same cells (their K may differ only by empty columns)."""
    if (a.k_start, a.k_end) != (b.k_start, b.k_end):
        return False
    k = max(a.per_row, b.per_row)
    arrays = []
    for iv in (a, b):
        pad = k - iv.per_row
        s = np.broadcast_to(iv.starts, (batch, q_len, iv.per_row))
        e = np.broadcast_to(iv.ends, (batch, q_len, iv.per_row))
        if pad:
            fill = np.full((batch, q_len, pad), iv.k_end, dtype=np.int64)
            s, e = np.concatenate([s, fill], -1), np.concatenate([e, fill], -1)
        arrays.append((s, e))
    return bool(np.array_equal(arrays[0][0], arrays[1][0]) and np.array_equal(arrays[0][1], arrays[1][1]))


def transpose(starts: np.ndarray, ends: np.ndarray, k_start: int, k_end: int) -> tuple[np.ndarray, np.ndarray]:
    """The column view of one batch row: for each key (local 0..Lk-1), its visible query rows as intervals.

    `starts`, `ends`: (Lq, K) absolute key intervals per query row. Returns (Lk, K') local row
    intervals (empty ones are [Lq, Lq)). Work is O(rows x K + changes): going down the rows,
    the keys that come into view at row q are row q & ~row q-1, those that leave are
    row q-1 & ~row q; a key's visible rows run from each arrival to the next departure.
    A mask whose rows change by many keys at once (more than EVENTS_PER_POSITION per
    position on average) is refused: its column view is not few intervals.
    """
    q_len, n_k = starts.shape[0], k_end - k_start
    empty_row = np.full((1, starts.shape[1]), k_end, dtype=np.int64)
    now = Intervals(starts[None], ends[None], k_start, k_end)
    before = Intervals(np.concatenate([empty_row, starts[:-1]])[None], np.concatenate([empty_row, ends[:-1]])[None], k_start, k_end)
    after = Intervals(np.concatenate([starts[1:], empty_row])[None], np.concatenate([ends[1:], empty_row])[None], k_start, k_end)
    arrive = now & ~before  # keys seen from row q on
    leave = now & ~after  # keys seen up to row q (they leave at q + 1)
    events = []
    for iv, shift in ((arrive, 0), (leave, 1)):
        s, e = iv.starts[0] - k_start, iv.ends[0] - k_start
        rows = np.broadcast_to(np.arange(q_len, dtype=np.int64)[:, None], s.shape)
        real = s < e
        s, e, rows = s[real], e[real], rows[real] + shift
        lengths = e - s
        total = int(lengths.sum())
        if total > EVENTS_PER_POSITION * (q_len + n_k):
            raise CannotHold(f"its rows change by {total:,} keys in all: the keys' row ranges are not few")
        first = np.cumsum(lengths) - lengths
        keys = np.repeat(s - first, lengths) + np.arange(total, dtype=np.int64)
        row = np.repeat(rows, lengths)
        order = np.lexsort((row, keys))  # by key, then row: arrivals and departures pair up in order
        events.append((keys[order], row[order]))
    (keys, on), (_, off) = events
    counts = np.bincount(keys, minlength=n_k)
    width = max(1, int(counts.max(initial=0)))
    rank = np.arange(keys.size) - np.repeat(np.cumsum(counts) - counts, counts)
    out_s = np.full((n_k, width), q_len, dtype=np.int64)
    out_e = np.full((n_k, width), q_len, dtype=np.int64)
    out_s[keys, rank] = on
    out_e[keys, rank] = off
    return out_s, out_e


def rows_of(intervals: list[tuple[np.ndarray, np.ndarray, np.ndarray]], rows: int, k_start: int, k_end: int) -> Intervals:
    """Intervals (1, rows, K) from (row, start, end) triples, any number per row, in any order (merged)."""
    row = np.concatenate([r for r, _, _ in intervals]).astype(np.int64)
    s = np.concatenate([x for _, x, _ in intervals]).astype(np.int64)
    e = np.concatenate([x for _, _, x in intervals]).astype(np.int64)
    real = s < e
    row, s, e = row[real], s[real], e[real]
    if row.size and (row.min() < 0 or row.max() >= rows):
        raise MaskError(f"a range reaches row {int(row.max()) if row.max() >= rows else int(row.min())}, outside the {rows} rows")
    counts = np.bincount(row, minlength=rows)
    width = max(1, int(counts.max(initial=0)))
    order = np.argsort(row, kind="stable")
    rank = np.arange(row.size) - np.repeat(np.cumsum(counts) - counts, counts)
    out_s = np.full((rows, width), k_end, dtype=np.int64)
    out_e = np.full((rows, width), k_end, dtype=np.int64)
    out_s[row[order], rank] = s[order]
    out_e[row[order], rank] = e[order]
    return Intervals.of(out_s[None], out_e[None], k_start, k_end)


def mask_of(intervals: Intervals, q_len: int, k_len: int, batch: int, name: str) -> Mask:
    """A Mask whose cells are the given intervals over keys 0..k_len-1 (read back from a kernel format), exact at
    any length; its queries sit at the end of its keys, as a tensor file's do."""
    frame = Frame(max(0, k_len - q_len), q_len, 0, k_len)
    from maskcli.kinds.base import Kind
    from maskcli.terms import Term

    def given_intervals(p, f):
        return intervals

    def predicate(p, f, device):
        import torch

        starts = torch.as_tensor(intervals.starts, device=device)
        ends = torch.as_tensor(intervals.ends, device=device)

        def given(b, h, q_idx, kv_idx):
            bi = b if starts.shape[0] > 1 else torch.zeros_like(b)
            qi = q_idx - f.q_start if starts.shape[1] > 1 else torch.zeros_like(q_idx)
            keep = torch.zeros((), dtype=torch.bool, device=device)
            for k in range(starts.shape[2]):  # K is small: one comparison per interval column
                keep = keep | ((starts[bi, qi, k] <= kv_idx) & (kv_idx < ends[bi, qi, k]))
            return keep

        return given

    kind = Kind(name=name, meaning=f"read from {name}", keep="the intervals read", params=(), example=name,
                intervals=given_intervals, predicate=predicate, rank=100)
    term = Term(kind, ())
    return Mask(name, frame, batch, 1, term, term)


def saved(tensors: dict, name: str, what: str, required: bool = True, index: bool = True):
    """One tensor of a file read with --from, as numpy int64, or a one-line error naming what is missing. `index`: the
    library takes it as an integer tensor (cu_seqlens, row indices), not as a Python number (causal, window_size)."""
    if name not in tensors:
        if not required:
            return None
        raise MaskError(f"{what}: the file has no tensor {name!r} (it has {', '.join(sorted(tensors)) or 'none'}): save it with maskcli export --save")
    value = tensors[name]
    given = str(value.dtype).removeprefix("torch.")  # as saved: a torch float is widened to float64 below
    if hasattr(value, "cpu"):
        value = value.cpu()
        value = (value.double() if value.is_floating_point() else value).numpy()
    values = np.asarray(value)
    if values.dtype.kind not in "biuf":
        raise MaskError(f"{what}: {name} is {values.dtype}, not integers: save it with maskcli export --save")
    flat = values.ravel()
    if index and values.dtype.kind == "b":  # flash_attn: "cu_seqlens_q must have dtype int32"; read as 0/1 it was another mask
        raise MaskError(f"{what}: {name} is a bool tensor ({flat[:8].tolist()}); the library takes integers (int32): "
                        f"save the index tensor itself, or maskcli export --save")
    if index and values.dtype.kind == "f" and np.all(np.isfinite(flat) & (flat == np.round(flat))) and flat.size:
        # the kernels take integer index tensors and refuse a float one (flash_attn: "cu_seqlens_q must have dtype
        # int32"): reading it as the integers it holds would show a mask the library never builds
        raise MaskError(f"{what}: {name} is a float tensor ({given}) holding whole numbers; the library takes "
                        f"integers (int32): save it with .int() or maskcli export --save")
    if values.dtype.kind == "f":  # a float that is not whole (or NaN) would be cut to another index by astype
        bad = ~np.isfinite(flat) | (flat != np.round(flat)) | (np.abs(flat) > LIMIT)
    else:
        bad = (flat > LIMIT) | ((flat < -LIMIT) if values.dtype.kind == "i" else False)
    if np.any(bad):
        raise MaskError(f"{what}: {name} holds {flat[np.argmax(bad)].item()!r}; its entries are whole numbers of at most "
                        f"{LIMIT:,} (indices and lengths)")
    return values.astype(np.int64)


LIMIT = 1 << 62  # past it, a sum of two indices wraps int64 (a length this large is then refused for its memory)


def scalar(tensors: dict, name: str, what: str):
    """One number of a file read with --from (saved as a 0-d or 1-element tensor), or None where absent."""
    value = saved(tensors, name, what, required=False, index=False)
    if value is None:
        return None
    if value.size != 1:
        raise MaskError(f"{what}: {name} must be one number, got shape {list(value.shape)}")
    return int(value.ravel()[0])


def check_rows(rows: int, what: str) -> None:
    """Refuse a file whose numbers describe more query rows than memory holds a few integers for."""
    from maskcli.memory import check_dense_fits

    check_dense_fits((max(int(rows), 0),), 8 * 6, "for its key intervals", what=f"{what}: a mask of",
                     fix="check the file's lengths: maskcli keeps a few integers per query row")


COMPACT_FIX = "a dense mask this long does not fit here: export it to a compact format (--for flash-attn, flashmask, magi or flex)"


def dense_cells(mask, bytes_per_cell: float, name: str) -> np.ndarray:
    """The mask's keep cells (B, H', Lq, Lk) for a dense format, refused up front where they cannot fit, with the
    formats that hold a long mask in O(L) as the way out."""
    from maskcli.memory import check_dense_fits

    heads = mask.heads if mask.heads_differ else 1
    check_dense_fits((mask.batch, heads, mask.frame.q_len, mask.frame.k_len), bytes_per_cell + 1, f"as {name}'s dense mask", fix=COMPACT_FIX)
    return mask.dense()
