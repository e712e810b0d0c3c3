"""Captured masks as maskcli stores them, and the trace file (`maskcli trace --save`) that reads back as a mask.

A stored mask is a plain dict (the file is loaded with weights_only=True, so it holds only
tensors, numbers, strings, lists and dicts). `shape` is the (B, H, Lq, Lk) the kernel
applied; `planes` is (b, h) as stored, each 1 where every batch row or head is the same.
Its form is "intervals" (per-row key intervals, `starts`/`ends` of (b*h, Lq, K), few per
row), "bits" (np.packbits of the rows, where the intervals are not few) or "stats" (past
--max-bytes: the shape and the counts only). Equal masks get equal stored forms, so the
digest of that form names a mask once however many calls use it.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np

from maskcli.errors import MaskError
from maskcli.intervals import Intervals, NotFew

FORMAT = "maskcli-trace-1"


def by_row(row: np.ndarray, start: np.ndarray, end: np.ndarray, rows: int, fill: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of shape (rows, K) from runs listed by row (`row` ascending), padded with [fill, fill)."""
    counts = np.bincount(row, minlength=rows)
    width = max(1, int(counts.max(initial=0)))
    rank = np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts, counts)  # each run's place in its row
    starts = np.full((rows, width), fill, dtype=np.int64)
    ends = np.full((rows, width), fill, dtype=np.int64)
    starts[row, rank] = start
    ends[row, rank] = end
    return starts, ends


def from_intervals(intervals: Intervals, shape: tuple[int, ...], planes: tuple[int, int]) -> dict:
    """A stored mask from intervals over keys [0, Lk) whose (B, Lq) rows are b*h planes (Lq may be 1: it broadcasts)."""
    q_len = shape[2]
    starts = np.ascontiguousarray(np.broadcast_to(intervals.starts, (intervals.starts.shape[0], q_len, intervals.per_row)))
    ends = np.ascontiguousarray(np.broadcast_to(intervals.ends, starts.shape))
    return {"form": "intervals", "shape": [int(x) for x in shape], "planes": [int(x) for x in planes], "starts": starts, "ends": ends}


def from_dense(keep: np.ndarray, shape: tuple[int, ...]) -> dict:
    """A stored mask from a bool (b, h, Lq, Lk) keep array (b, h each 1 or the full size): intervals where few, else bits."""
    b, h, q_len, k_len = keep.shape
    rows = keep.reshape(b * h * q_len, k_len)
    try:
        from maskcli.kinds.padding import key_runs

        runs = key_runs(rows, SimpleNamespace(k_start=0, k_end=k_len), "the captured mask")
    except NotFew:
        packed = np.packbits(keep, axis=-1)
        return {"form": "bits", "shape": [int(x) for x in shape], "planes": [b, h], "bits": packed}
    k = runs.per_row
    stored = Intervals(runs.starts.reshape(b * h, q_len, k), runs.ends.reshape(b * h, q_len, k), 0, k_len)
    return from_intervals(stored, shape, (b, h))


def stats_only(shape: tuple[int, ...], kept: int, empty_rows: int, why: str) -> dict:
    return {"form": "stats", "shape": [int(x) for x in shape], "planes": [1, 1], "kept": int(kept), "empty_rows": int(empty_rows), "why": why}


def digest(stored: dict) -> str:
    """What names a stored mask: its form, planes, shape and content (two calls of the same mask share it)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((stored["form"], stored["planes"], stored["shape"][2:])).encode())
    for name in ("starts", "ends", "bits"):
        if name in stored:
            h.update(np.ascontiguousarray(stored[name]).tobytes())
    if stored["form"] == "stats":
        h.update(repr((stored["shape"], stored["kept"], stored["empty_rows"])).encode())
    return h.hexdigest()


def nbytes(stored: dict) -> int:
    return sum(stored[name].nbytes for name in ("starts", "ends", "bits") if name in stored)


def intervals(stored: dict) -> Intervals | None:
    """The stored mask's intervals as (b*h, Lq, K) planes; None where it is kept as bits or stats."""
    if stored["form"] != "intervals":
        return None
    return Intervals(np.asarray(stored["starts"]), np.asarray(stored["ends"]), 0, stored["shape"][3])


def counts(stored: dict) -> np.ndarray | None:
    """Keys seen per row, int64 (b, h, Lq); None for stats."""
    b, h = stored["planes"]
    q_len, k_len = stored["shape"][2:]
    if stored["form"] == "intervals":
        return intervals(stored).counts().reshape(b, h, q_len)
    if stored["form"] == "bits":
        return dense(stored).sum(axis=-1)
    return None


def dense(stored: dict) -> np.ndarray:
    """Bool (b, h, Lq, Lk) as stored (dimensions of size 1 broadcast to the call's shape)."""
    b, h = stored["planes"]
    q_len, k_len = stored["shape"][2:]
    if stored["form"] == "bits":
        return np.unpackbits(np.asarray(stored["bits"]), axis=-1, count=k_len).astype(bool)
    if stored["form"] == "stats":
        raise MaskError(f"the mask of this call was not kept ({stored['why']}): trace again with a larger --max-bytes")
    from maskcli.memory import check_dense_fits

    check_dense_fits((b * h, q_len, k_len), 1, "as a bool array")
    if b * h == 0:  # a call over a batch of 0 rows (or 0 heads): no plane to stack
        return np.zeros((b, h, q_len, k_len), dtype=bool)
    found = intervals(stored)
    return np.stack([found.dense(plane, 0, q_len) for plane in range(b * h)]).reshape(b, h, q_len, k_len)


# --- the file -----------------------------------------------------------------------------------


def plain(stored: dict) -> dict:
    """A stored mask with its arrays as tensors (what torch.load(weights_only=True) reads back)."""
    import torch

    return {key: torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value for key, value in stored.items()}


def _plain_value(value):
    """A call's details as torch.load(weights_only=True) reads them back: numpy arrays and scalars the program's frames
    held (trace/held.py: a padding mask, lengths) as lists and numbers."""
    if isinstance(value, dict):
        return {key: _plain_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain_value(item) for item in value)
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    return value


def save(path, calls: list[dict], masks: dict[str, dict], ranks: list[dict] | None = None) -> None:
    """One .pt file of plain tensors, lists and dicts: every call, and each distinct mask once; `ranks`, for a job of
    several processes: each rank's exit status, calls and process groups (its calls carry their rank)."""
    import torch

    calls = [{**call, "details": _plain_value(call["details"])} if "details" in call else call for call in calls]
    data = {"format": FORMAT, "calls": calls, "masks": {key: plain(value) for key, value in masks.items()}}
    if ranks is not None:
        data["ranks"] = ranks
    torch.save(data, path)


def load(path: str) -> dict:
    """A trace file read with weights_only=True and checked whole (every field's type and range) where it is read,
    so that a damaged or crafted file is one line naming what is wrong, never a wrong mask or an internal error."""
    import warnings

    import torch

    from maskcli.files import readable_file

    readable_file(path, f"trace file {path!r}")  # a FIFO would block torch.load forever, a folder fail inside it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Detected pickle protocol 4" on a file that is no trace: a second line
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # any damage (a /proc file torch cannot seek in): what torch said, in one line
        raise MaskError(f"{path!r} is not a trace file maskcli can read ({' '.join(str(error).split())[:160]})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise MaskError(f"{path!r} is a .pt file but not a maskcli trace (write one with maskcli trace --save {path})")
    where = f"trace file {path!r}"
    masks, calls = data.get("masks"), data.get("calls")
    if not isinstance(masks, dict) or not isinstance(calls, list):
        raise MaskError(f"{where} is damaged: it needs a list 'calls' and a dict 'masks' (got {type(calls).__name__} and "
                        f"{type(masks).__name__}); write it again with maskcli trace --save")
    for name, stored in masks.items():
        if not isinstance(stored, dict):
            raise MaskError(f"{where} is damaged: mask {_quoted(name)} is a {type(stored).__name__}, not a stored mask")
        for key, value in list(stored.items()):
            if isinstance(value, torch.Tensor):
                if value.is_nested or value.layout != torch.strided or value.device.type == "meta" or value.is_quantized:
                    raise MaskError(f"{where} is damaged: mask {_quoted(name)}'s {key!r} is not a plain tensor")
                stored[key] = value.numpy()
        _check_mask(stored, f"{where} is damaged: mask {_quoted(name)}")
    for index, call in enumerate(calls):
        _check_call(call, masks, f"{where} is damaged: call {index}")
    _check_ranks(data, calls, f"{where} is damaged")
    return data


def _check_ranks(data: dict, calls: list, where: str) -> None:
    """A trace of several ranks (trace under torchrun) lists them in 'ranks' and gives every call its rank, a whole
    number; a trace of one process has neither."""
    ranked = [call for call in calls if "rank" in call]
    for call in ranked:
        rank = call["rank"]
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank <= LIMIT:
            raise MaskError(f"{where}: call {calls.index(call)}'s rank is {_quoted(rank)}; it is a whole number from 0")
    if "ranks" not in data:
        if ranked:
            raise MaskError(f"{where}: its calls name ranks but it lists none ('ranks'); write it again with maskcli trace --save")
        return
    ranks = data["ranks"]
    if not isinstance(ranks, list) or not ranks or not all(isinstance(one, dict) for one in ranks) \
            or len(ranked) != len(calls):
        raise MaskError(f"{where}: 'ranks' is {_quoted(ranks)} with {len(ranked)} of its {len(calls)} calls ranked; a trace "
                        "of several ranks lists each rank and ranks every call: write it again with maskcli trace --save")


LIMIT = 1 << 40  # no traced length comes near a trillion; past it the sizes below would wrap int64


def _quoted(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _sizes(value, count: int, what: str, where: str) -> list[int]:
    if not (isinstance(value, (list, tuple)) and len(value) == count and
            all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= LIMIT for n in value)):
        raise MaskError(f"{where}: {what} is {_quoted(value)}; it is {count} whole sizes from 0 to {LIMIT:,}")
    return list(value)


def _check_mask(stored: dict, where: str) -> None:
    """A stored mask's form, shape, planes and arrays agree: intervals of int starts <= ends within [0, Lk), bits of
    uint8 rows as long as the keys, stats of counts."""
    form = stored.get("form")
    if form not in ("intervals", "bits", "stats"):
        raise MaskError(f"{where}: form {_quoted(form)} is not intervals, bits or stats")
    batch, heads, q_len, k_len = _sizes(stored.get("shape"), 4, "shape", where)
    b, h = _sizes(stored.get("planes"), 2, "planes", where)
    if b not in (1, batch) or h not in (1, heads):
        raise MaskError(f"{where}: planes {[b, h]} do not match shape {[batch, heads, q_len, k_len]} (each 1 or the full size)")
    if form == "stats":
        for key in ("kept", "empty_rows"):
            if not isinstance(stored.get(key), int) or stored[key] < 0:
                raise MaskError(f"{where}: {key} is {_quoted(stored.get(key))}; it is a count")
        if not isinstance(stored.get("why"), str):
            raise MaskError(f"{where}: why is {_quoted(stored.get('why'))}; it is a sentence")
        return
    names = ("starts", "ends") if form == "intervals" else ("bits",)
    for key in names:
        value = stored.get(key)
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu" or value.ndim != (4 if form == "bits" else 3):
            dims = ("4 dimensions (batch planes, head planes, queries, bytes of keys)" if form == "bits" else
                    "3 dimensions (planes, queries, intervals per row)")
            raise MaskError(f"{where}: {key} is {_quoted(getattr(value, 'dtype', value))} {list(getattr(value, 'shape', []))}; "
                            f"it is an integer array of {dims}")
    if form == "bits":
        expected = (b, h, q_len, -(-k_len // 8))
        if stored["bits"].dtype != np.uint8 or stored["bits"].shape != expected:
            raise MaskError(f"{where}: bits has shape {list(stored['bits'].shape)} ({stored['bits'].dtype}); "
                            f"planes and shape say {list(expected)} (uint8)")
        return
    starts, ends = stored["starts"], stored["ends"]
    if starts.shape != ends.shape or starts.shape[:2] != (b * h, q_len) or starts.shape[2] < 1:
        raise MaskError(f"{where}: starts {list(starts.shape)} and ends {list(ends.shape)} are not both "
                        f"(planes {b * h}, queries {q_len}, intervals per row)")
    bad = (starts < 0) | (starts > ends) | (ends > k_len)
    if bad.any():
        i = np.unravel_index(int(np.argmax(bad)), bad.shape)
        raise MaskError(f"{where}: interval [{int(starts[i])}, {int(ends[i])}) of row {int(i[1])} is not within the "
                        f"{k_len} keys (0 <= start <= end <= {k_len})")


def _check_call(call, masks: dict, where: str) -> None:
    """A call names a stored mask whose planes broadcast to its shape, with the fields readers show."""
    if not isinstance(call, dict):
        raise MaskError(f"{where} is a {type(call).__name__}, not a call")
    if not isinstance(call.get("mask"), str) or call["mask"] not in masks:
        raise MaskError(f"{where} names mask {_quoted(call.get('mask'))}, which the file does not hold")
    shape = _sizes(call.get("shape"), 4, "shape", where)
    stored = masks[call["mask"]]
    if stored["shape"][2:] != shape[2:] or any(p not in (1, n) for p, n in zip(stored["planes"], shape[:2])):
        raise MaskError(f"{where}: shape {shape} does not match its mask's (planes {stored['planes']}, "
                        f"{stored['shape'][2]} x {stored['shape'][3]})")
    for key, kind in (("where", str), ("api", str), ("index", int), ("step", int), ("details", dict)):
        if key in call and not isinstance(call[key], kind) or kind is int and isinstance(call.get(key), bool):
            raise MaskError(f"{where}: {key} is {_quoted(call[key])}; it is {'text' if kind is str else 'a ' + kind.__name__}")
    if not isinstance(call.get("where"), str) or not isinstance(call.get("step"), int):
        raise MaskError(f"{where} lacks its 'where' (text) or 'step' (a number)")
    details = call.get("details", {})
    if "step_name" in details and not isinstance(details["step_name"], str):
        raise MaskError(f"{where}: details step_name is {_quoted(details['step_name'])}; it is text")
    padding = details.get("key_padding")
    if padding is not None:
        from maskcli.keypadding import valid

        try:
            ok = isinstance(padding, dict) and (not padding or valid(padding, shape[0], shape[3]).shape == (shape[0], shape[3]))
        except (ValueError, TypeError, AttributeError, KeyError):
            ok = False
        if not ok:
            raise MaskError(f"{where}: details key_padding {_quoted(padding)} is not {shape[0]} rows of {shape[3]} keys")


def keep_of(call: dict, data: dict) -> np.ndarray:
    """The call's keep mask, bool (b, h, Lq, Lk) with b and h each 1 or the call's own."""
    return dense(data["masks"][call["mask"]])
