"""Sequences and a band: the masks FlashAttention, FlashInfer and xformers take without a mask tensor.

Those kernels see a batch of sequences (varlen: packed one after another, cut by
cu_seqlens), each with `lq` queries and `lk` keys, and inside each one the same band
around the bottom-right diagonal: query i (local) sees key j when

    i + lk - lq - left <= j <= i + lk - lq + right          (left, right = -1: no limit)

which is FlashAttention's documented window rule (causal is right = 0). A mask is read
as such when each query row sees one run of keys; its sequences are the batch rows'
unpadded tokens, cut where no row sees across (the finest cut, which holds the mask
whenever any cut does); the band is read off the rows and the whole is rebuilt and
compared with the mask exactly, so what is returned always holds the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maskcli.formats.base import CannotHold, plain_rows
from maskcli.intervals import Intervals
from maskcli.mask import Mask

NO_LIMIT = -1
ELSEWHERE = "use --for flex or magi, or a dense --for sdpa mask"


@dataclass(frozen=True)
class Sequences:
    """Sequences (absolute positions, with their batch row) and the band inside each."""

    batch: np.ndarray  # (N,) batch row of each sequence
    q_lo: np.ndarray  # (N,) absolute query positions [q_lo, q_hi)
    q_hi: np.ndarray
    k_lo: np.ndarray  # (N,) absolute key positions [k_lo, k_hi)
    k_hi: np.ndarray
    left: int  # keys before the diagonal, -1: any
    right: int  # keys after the diagonal, -1: any
    dropped_rows: int  # padding query rows that no sequence holds (unpad_input drops them)
    cache: bool = False  # one sequence per batch row behind a left-padded KV cache (flash_attn_with_kvcache)

    @property
    def q_lens(self) -> np.ndarray:
        return self.q_hi - self.q_lo

    @property
    def k_lens(self) -> np.ndarray:
        return self.k_hi - self.k_lo

    @property
    def causal(self) -> bool:
        return self.right == 0

    @property
    def square(self) -> bool:
        return bool(np.array_equal(self.q_lens, self.k_lens))


def band_rows(q_lens, k_lens, left: int, right: int, k_base=None) -> tuple[np.ndarray, np.ndarray]:
    """Per query row of the packed sequences, its [start, end) keys (packed key positions) under the band rule."""
    q_lens, k_lens = np.asarray(q_lens, dtype=np.int64), np.asarray(k_lens, dtype=np.int64)
    k_base = np.cumsum(k_lens) - k_lens if k_base is None else np.asarray(k_base, dtype=np.int64)
    seq = np.repeat(np.arange(q_lens.size), q_lens)
    i = np.arange(int(q_lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
    diag = i + (k_lens - q_lens)[seq]  # the local key on query i's diagonal
    lo = np.zeros_like(i) if left < 0 else np.maximum(0, diag - left)
    hi = np.repeat(k_lens, q_lens) if right < 0 else np.minimum(k_lens[seq], diag + right + 1)
    lo = np.minimum(lo, k_lens[seq])
    hi = np.maximum(hi, lo)
    return lo + k_base[seq], hi + k_base[seq]


def sequences(mask: Mask, what: str) -> Sequences:
    """The sequences and band that hold `mask` exactly, or CannotHold saying why."""
    f = mask.frame
    starts, ends = plain_rows(mask, what)
    if starts.shape[2] > 1:
        raise CannotHold(f"{what} cannot express {mask.title}: some query rows see {starts.shape[2]} separate runs of keys, and its sequences give each row one: {ELSEWHERE}")
    s, e = starts[..., 0], ends[..., 0]
    square = f.q_start == f.k_start and f.q_len == f.k_len
    cache = f.padded and not square
    parts = []
    dropped = 0
    for b in range(mask.batch):
        lo, hi = f.q_start, f.q_end
        valid_keys = f.key_valid[b if f.key_valid.shape[0] > 1 else 0] if f.padded else None  # one padding row may serve every batch row
        if cache:  # queries behind a cache: each batch row's keys must be one run that ends with the cache (left padding)
            real = np.flatnonzero(valid_keys[f.k_start:f.k_end])
            if real.size == 0 or real[-1] != f.k_len - 1 or real.size != f.k_len - real[0] or not valid_keys[f.q_start:f.q_end].all():
                raise CannotHold(f"{what} cannot express batch row {b} behind a cache: its real keys must be one run ending at the last key "
                                 f"(left padding, cache_leftpad) and every query real ({f.describe()}): use --for sdpa")
            parts.append((b, [lo], [hi], [f.k_start + int(real[0])], [f.k_end]))
            continue
        if f.padded:
            valid = valid_keys[f.q_start:f.q_end]
            real = np.flatnonzero(valid)
            if real.size == 0:
                continue
            lo, hi = f.q_start + int(real[0]), f.q_start + int(real[-1]) + 1
            if real.size != hi - lo:
                raise CannotHold(f"{what} cannot express batch row {b}: its real tokens are not one run (padding inside it): use --for sdpa")
            dropped += f.q_len - real.size
        rows = slice(lo - f.q_start, hi - f.q_start)
        if square:
            cuts = _cuts(s[b, rows], e[b, rows], lo, hi)
            bounds = np.concatenate([[lo], cuts, [hi]])
            parts.append((b, bounds[:-1], bounds[1:], bounds[:-1], bounds[1:]))
        else:
            parts.append((b, [lo], [hi], [f.k_start], [f.k_end]))
    if not parts:
        raise CannotHold(f"{what} cannot express {mask.title}: every token is padding")
    batch = np.concatenate([np.full(len(p[1]), p[0]) for p in parts]).astype(np.int64)
    q_lo, q_hi, k_lo, k_hi = (np.concatenate([np.asarray(p[i], dtype=np.int64) for p in parts]) for i in range(1, 5))
    rows_s = _gather(s, batch, q_lo - f.q_start, q_hi - f.q_start)
    rows_e = _gather(e, batch, q_lo - f.q_start, q_hi - f.q_start)
    q_lens, k_lens = q_hi - q_lo, k_hi - k_lo
    seq = np.repeat(np.arange(batch.size), q_lens)
    q = np.arange(int(q_lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(q_lens) - q_lens - q_lo, q_lens)  # absolute
    shift = (k_hi - q_hi)[seq]  # the diagonal: key q + shift
    seen = rows_s < rows_e
    left = _constant(q + shift - rows_s, seen & (rows_s > k_lo[seq]), what, mask, "left")
    right = _constant(rows_e - 1 - q - shift, seen & (rows_e < k_hi[seq]), what, mask, "right")
    found = Sequences(batch, q_lo, q_hi, k_lo, k_hi, left, right, dropped, cache)
    want_s, want_e = band_rows(q_lens, k_lens, left, right, k_lo)
    empty_want = want_s >= want_e
    if not (np.array_equal(np.where(seen, rows_s, 0), np.where(empty_want, 0, want_s)) and
            np.array_equal(np.where(seen, rows_e, 0), np.where(empty_want, 0, want_e)) and np.array_equal(seen, ~empty_want)):
        raise CannotHold(f"{what} cannot express {mask.title}: its rows are not one band (window and causal) inside each sequence: {ELSEWHERE}")
    return found


def left_out(found: Sequences, mask: Mask) -> list[str]:
    """Notes on the padding a packed layout leaves out: query rows (as unpad_input drops them) and, behind a
    left-padded cache, each row's padding keys."""
    notes = []
    if found.dropped_rows:
        notes.append(f"{found.dropped_rows} padding query rows are left out: pack only the real tokens")
    if found.cache and bool(np.any(found.k_lo > mask.frame.k_start)):
        notes.append("each batch row's padding keys are left out: pack only its real keys")
    return notes


def _gather(a: np.ndarray, batch: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Rows lo..hi-1 of batch row b for each (b, lo, hi), concatenated, without a Python loop per sequence."""
    lens = hi - lo
    local = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens - lo, lens)
    return a[np.repeat(batch, lens), local]


def _cuts(s: np.ndarray, e: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Positions p in (lo, hi) where no row before p sees a key at or after p and no row from p on sees one before it."""
    seen = s < e
    reach = np.maximum.accumulate(np.where(seen, e, lo))  # furthest key end of rows lo..p-1
    back = np.minimum.accumulate(np.where(seen, s, hi)[::-1])[::-1]  # earliest key of rows p..hi-1
    p = np.arange(lo + 1, hi)
    return p[(reach[:-1] <= p) & (back[1:] >= p)]


def _constant(values: np.ndarray, where: np.ndarray, what: str, mask: Mask, side: str) -> int:
    found = np.unique(values[where])
    if found.size == 0:
        return NO_LIMIT
    if found.size > 1 or found[0] < 0:
        raise CannotHold(f"{what} cannot express {mask.title}: the rows' {side} edges are not one window around the diagonal: {ELSEWHERE}")
    return int(found[0])


def rebuilt(found: Sequences, k_start: int, k_end: int) -> Intervals:
    """The packed mask the sequences and band give, for reading a format back (queries and keys packed from 0)."""
    s, e = band_rows(found.q_lens, found.k_lens, found.left, found.right)
    return Intervals.of(s[None, :, None], e[None, :, None], k_start, k_end)
