"""Where a mask's queries and keys sit: absolute positions, and the batch data that goes with them.

Queries sit at positions q_start .. q_start+Lq-1 (`--offset`: the tokens already in a KV
cache); keys at k_start .. k_start+Lk-1 (`--kv-start`, `--kv-len`). Labels, token ids and
words cover the whole sequence 0 .. n-1, n = max(q_end, k_end), and are indexed by
absolute position. Kinds are defined on absolute positions, so every kind works behind a
cache with no special case.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from maskcli.errors import MaskError

DEFAULT_LEN = 8
MAX_LEN = 1 << 40  # positions are int64; past this no view of a mask is useful
ALIGNS = ("top-left", "bottom-right")


@dataclass(frozen=True, eq=False)
class Frame:
    """Positions of queries and keys, and key padding per batch row (None: no padding)."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    key_valid: np.ndarray | None = None  # bool (B, n): False at pad positions
    lengths: tuple[int, ...] | None = None  # --lengths as given
    ids: np.ndarray | None = None  # int64 (B, n): --ids as given
    pad_id: int | None = None
    pad_side: str = "right"  # where --lengths puts the padding (--pad): right, or left as Hugging Face's padding_side

    # read once per frame (its fields never change): every kind placed on one frame, recognition's candidates
    # among them, reads them off the frame rather than working them out again
    @functools.cached_property
    def q_end(self) -> int:
        return self.q_start + self.q_len

    @functools.cached_property
    def k_end(self) -> int:
        return self.k_start + self.k_len

    @functools.cached_property
    def n(self) -> int:
        """Length of the sequence the positions index: labels and words cover 0..n-1."""
        return max(self.q_end, self.k_end)

    @property
    def batch(self) -> int:
        return 1 if self.key_valid is None else self.key_valid.shape[0]

    @property
    def padded(self) -> bool:
        return self.key_valid is not None

    def left_padding(self) -> np.ndarray:
        """int64 (B,): pad positions before each batch row's first real token (0 without --ids).

        As Hugging Face counts them for chunked attention: positions where the running
        count of real tokens is still 0.
        """
        if self.ids is None and self.pad_side == "right":
            return np.zeros(self.batch, dtype=np.int64)
        return (np.cumsum(self.key_valid, axis=1) == 0).sum(axis=1).astype(np.int64)

    def first_real(self, b: int) -> int:
        """left_padding() of batch row b alone (one row of --ids or --lengths serves every batch row)."""
        if self.ids is None and self.pad_side == "right":
            return 0
        valid = self.key_valid[b if self.key_valid.shape[0] > 1 else 0]
        first = int(np.argmax(valid))
        return first if valid[first] else len(valid)

    @functools.cached_property
    def q_positions(self) -> np.ndarray:
        """int64 absolute query positions, made once per frame and read-only (every kind placed on it shares them)."""
        found = np.arange(self.q_start, self.q_end, dtype=np.int64)
        found.flags.writeable = False
        return found

    @functools.cached_property
    def q_column(self) -> np.ndarray:
        """q_positions as a (1, Lq, 1) column, one key interval per query row: what the kinds' intervals start from,
        made once per frame (read-only, like q_positions)."""
        return self.q_positions.reshape(1, -1, 1)

    def describe(self) -> str:
        """'queries 4-5 · keys 0-5' in words, for headers."""
        return f"queries {_span(self.q_start, self.q_end)} · keys {_span(self.k_start, self.k_end)}"

    def is_plain(self) -> bool:
        """Queries and keys both 0..L-1: headers need not say where they sit."""
        return self.q_start == 0 and self.k_start == 0 and self.q_len == self.k_len


def _span(start: int, end: int) -> str:
    return f"{start}" if end - start == 1 else f"{start}-{end - 1}"


def check_size(value: int | None, flag: str, what: str, minimum: int = 1) -> None:
    if value is None:
        return
    if value < minimum:
        raise MaskError(f"{flag} must be at least {minimum} ({what}), got {value}")
    if value > MAX_LEN:
        raise MaskError(f"{flag} {value} is too large: at most {MAX_LEN:,}")


def resolve(
    *,
    length: int | None,
    offset: int | None,
    kv_start: int | None,
    kv_len: int | None,
    align: str | None,
    sequence: tuple[str, int] | None,
    queries: int | None,
    default: int = DEFAULT_LEN,
) -> tuple[int, int, int, int]:
    """(q_start, q_len, k_start, k_len) from the flags and from what the data says.

    `sequence`: (what, length) the labels, ids, words or lengths give (they cover 0..n-1); `queries`:
    the number of queries a kind fixes (a draft tree's tokens). Without --len the queries
    run to the end of that sequence, else there are `default` of them.
    """
    check_size(length, "--len", "the number of queries")
    check_size(offset, "--offset", "tokens already in the KV cache", minimum=0)
    check_size(kv_start, "--kv-start", "the first key position kept in the cache", minimum=0)
    check_size(kv_len, "--kv-len", "the number of keys")
    if align is not None and align not in ALIGNS:
        raise MaskError(f"unknown --align {align!r}: choose top-left or bottom-right")
    if align is not None and kv_len is None:
        raise MaskError(
            f"--align {align} places the queries against --kv-len keys; without --kv-len the keys end at the last "
            "query already: give --kv-len N, or drop --align"
        )
    if align is not None and offset is not None:
        raise MaskError(f"give --offset {offset} or --align {align}, not both: each says where the queries sit")
    if length is None:
        if queries is not None:
            length = queries
        elif sequence is not None:
            what, count = sequence
            length = count - (offset or 0)
            if length < 1:
                raise MaskError(
                    f"{what} give {count} position{'s' if count != 1 else ''}, none left for a query after "
                    f"--offset {offset or 0}: give --len, or more of them"
                )
        else:
            length = default
    elif queries is not None and length != queries:
        raise MaskError(f"--len {length} does not match the {queries} draft tokens of the tree: drop --len")
    k_start = kv_start or 0
    if kv_len is None:
        q_start = offset or 0
        k_end = q_start + length
        if k_start >= k_end:
            raise MaskError(
                f"--kv-start {k_start} leaves no key: the keys run to the last query, position {k_end - 1}; "
                "use a smaller --kv-start, or give --kv-len"
            )
        return q_start, length, k_start, k_end - k_start
    if offset is not None:
        q_start = offset
    elif align == "bottom-right":
        q_start = k_start + kv_len - length
        if q_start < 0:
            raise MaskError(
                f"--align bottom-right puts the last of {length} queries on the last of {kv_len} keys, "
                f"so the first query would sit at position {q_start}: give fewer queries (--len) or more keys"
            )
    else:  # top-left: query 0 faces key 0, as SDPA's is_causal aligns them
        q_start = k_start
    return q_start, length, k_start, kv_len


def data_length(what: str, count: int, frame: Frame) -> None:
    """Refuse labels, ids or words that do not cover the sequence 0..n-1 exactly."""
    if count != frame.n:
        raise MaskError(
            f"{what} {'has' if count == 1 else 'have'} {count} entr{'y' if count == 1 else 'ies'} but the mask covers "
            f"positions 0-{frame.n - 1} ({frame.n} positions: {frame.describe()}): give one per position, "
            "or change --len/--offset/--kv-len"
        )


@functools.lru_cache(maxsize=64)
def index_tensor(values: range, axis: int, device):
    """Indices along `axis` of four dimensions, as a mask_mod receives them; cached, for a mask_mod only reads them."""
    import torch

    shape = [1, 1, 1, 1]
    shape[axis] = len(values)
    return torch.arange(values.start, values.stop, dtype=torch.int64, device=device).view(shape)
