"""Keys packed from a padded batch, read against the mask the program packed them by (checks/gathered.py).

A varlen path unpads: it gathers each sequence's keys out of a padded (B, Lk, H, D) or (B, H, Lk, D) key tensor and
hands the kernel only those, with no mask. Which keys it gathered is not in the kernel's call; it is in the values: at a
kernel call that masks nothing (no attn_mask, not causal) and sees fewer keys than a padded key tensor a nearby program
frame holds beside a bool / 0-1 mask over the same (B, Lk), each of the kernel's key rows is matched, by exact value, to
the (batch row, position) it was taken from. Keys of one batch row taken at positions the mask marks both ways contradict
the mask whichever way round it is read: such a gather follows no mask (diffusers#14115: `key[b, :mask.sum()]`, a
prefix taken for the kept keys, packs the text padding of a [text, image] sequence and drops the last image tokens).
Keys of several batch rows in one call (a square self-attention of one sequence, its i-th query the i-th key's token)
of which a query of one row sees a key of another, unmasked or under the call's own mask or is_causal, merge rows the
mask holds apart (cehrgpt d834e07: a left-padded batch taken for a sample pack, cut at the flattened mask's zeros into
one varlen segment). Keys cast to bfloat16 or float16 on their way to the kernel (and back) are matched in that type.
Bounded: padded tensors of at most CELLS elements, the kernel's rows hashed once per call.
"""

from __future__ import annotations

import functools
import os
import re
import sys

import numpy as np
import torch

CELLS = 1 << 20  # elements of a padded key tensor past which nothing is matched
FRAMES = 3  # program frames looked at: the function that called the kernel, its caller and theirs
MASKS = re.compile(r"(?:^|_)(?:attn_mask|attention_mask|mask|padding_mask|key_padding_mask|pad_mask)$")


@functools.cache
def _skip() -> tuple[str, ...]:
    return (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "<")


def note(seen, key: torch.Tensor, kept: np.ndarray | None = None) -> None:
    """Set seen.details["gathered_keys"] where the kernel's keys `key` (.., H, n, D) are gathered from one padded row
    across positions its mask marks both ways, and seen.details["gathered_rows"] where they are gathered from several
    rows of which a query of one sees a key of another (`kept`: the (n, n) cells a masked call keeps; None: every one)."""
    if key.dim() not in (3, 4) or key.dim() == 4 and key.shape[0] != 1 or key.is_floating_point() is False:
        return
    rows = key.reshape(key.shape[-3], key.shape[-2], key.shape[-1]).transpose(0, 1)  # (n, H, D)
    n, heads, dim = (int(x) for x in rows.shape)
    frame, searched, skip = sys._getframe(1), 0, _skip()
    while frame is not None and searched < FRAMES:
        if not frame.f_code.co_filename.startswith(skip):
            searched += 1
            found = _in_frame(frame, rows, n, heads, dim, kept) if _named(frame.f_code) else None
            if found is not None:
                seen.details["gathered_rows" if "rows" in found else "gathered_keys"] = found
                return
        frame = frame.f_back


_NAMED: dict = {}  # code object -> whether it names a mask (MASKS) among its variables (matched once per code)


def _named(code) -> bool:
    named = _NAMED.get(code)
    if named is None:
        if len(_NAMED) > 4096:
            _NAMED.clear()
        named = _NAMED[code] = any(MASKS.search(name) for name in code.co_varnames + code.co_cellvars)
    return named


def _masks(variables: dict, n: int) -> list:
    """(name, bool (B, Lk)) of the frame's masks over more than `n` keys, or of several rows over at least half as many
    (rows' tokens packed, each row holding some of them): 2-D, or (B, 1, 1, Lk); bools or 0/1."""
    found = []
    for name, value in variables.items():
        if not (issubclass(type(value), torch.Tensor) and MASKS.search(name)) or value.numel() > CELLS or value.dim() < 2 \
                or value.shape[-1] <= n and (value.shape[0] < 2 or 2 * value.shape[-1] < n):
            continue  # (no more keys than the kernel has, one row: nothing was gathered; read no values)
        if value.dim() == 4 and value.shape[1] == value.shape[2] == 1:
            value = value[:, 0, 0]
        if value.dim() != 2 or value.shape[1] < 2:
            continue
        table = value.detach().cpu()
        if table.dtype != torch.bool:
            if not bool(((table == 0) | (table == 1)).all()):
                continue
            table = table != 0
        found.append((name, table.numpy()))
    return found


def _padded(variables: dict, rows: int, length: int, heads: int, dim: int):
    """(name, (B, Lk, H, D)) of the frame's float tensors laid out (B, Lk, H, D) or (B, H, Lk, D)."""
    for name, value in variables.items():
        if not issubclass(type(value), torch.Tensor) or not value.is_floating_point() or value.dim() != 4 \
                or value.numel() > CELLS or value.shape[0] != rows:
            continue
        shape = tuple(int(x) for x in value.shape)
        if shape[1:] == (length, heads, dim):
            yield name, value, value
        elif shape[1:] == (heads, length, dim):
            yield name, value, value.transpose(1, 2)


def _in_frame(frame, rows: torch.Tensor, n: int, heads: int, dim: int, kept: np.ndarray | None) -> dict | None:
    variables = frame.f_locals
    for mask_name, mask in _masks(variables, n):
        b_len, length = mask.shape
        for key_name, held, padded in _padded(variables, b_len, length, heads, dim):
            at = _positions(held, padded, rows)
            if at is None:
                continue
            batch = {b for b, _ in at}
            where = f"{frame.f_code.co_name}()"
            if len(batch) != 1:  # (keys of several rows in one kernel call: self-attention, its i-th query the i-th key's
                return _across(at, kept, f"{mask_name} of {where}", f"{key_name} of {where}")  # token)
            if kept is not None:
                return None  # (a masked call's keys of one row: the mask is the kernel's to say)
            if length <= n:
                continue  # (no more keys than the kernel has: a whole row's, nothing gathered)
            b = batch.pop()
            taken = sorted(p for _, p in at)
            marks = mask[b, taken]
            if marks.all() or not marks.any():
                return None  # (one value of the mask throughout: a gather that follows it, either way round)
            return {"mask": f"{mask_name} of {where}", "keys": f"{key_name} of {where}", "row": b,
                    "taken": taken, "marked": [int(p) for p in np.flatnonzero(mask[b])], "length": length}
    return None


_PLACES: dict = {}  # (id, version) of a padded key tensor -> (it, {row bytes: [flat indices]}): hashed once


def _across(at: list, kept: np.ndarray | None, mask: str, keys: str) -> dict | None:
    """A query of one batch row that sees a key of another, the i-th query read as the i-th key's token (a varlen
    self-attention gathers its queries and keys by the same indices); None where every query keeps to its row."""
    row = np.array([b for b, _ in at])
    other = row[:, None] != row[None, :]
    leak = other if kept is None else other & kept
    if not leak.any():
        return None
    i, j = (int(x) for x in np.argwhere(leak)[0])
    return {"mask": mask, "keys": keys, "rows": sorted({int(b) for b in row}), "query": (i, *at[i]), "key": (j, *at[j]),
            "count": int(leak.sum())}


def _positions(held: torch.Tensor, padded: torch.Tensor, rows: torch.Tensor) -> list | None:
    """[(b, position)] of each kernel key row in `padded` (B, Lk, H, D, a view of the frame's `held`), matched by exact
    value; None where a row is found nowhere or in more than one place (repeated rows: no provenance)."""
    rows = rows.detach()
    if padded.dtype != rows.dtype or not _places(held, padded).get(_bytes(rows[:1].reshape(1, -1))[0].tobytes()):
        narrow = _narrowed(rows)  # (keys cast to a narrower type on their way to the kernel, and back: cehrgpt's
        if narrow is None:  # bf16 stand-in of flash_attn, fed `.float()`)
            return None
        rows = rows.to(narrow)
    wanted = _bytes(rows.reshape(rows.shape[0], -1))
    places = _places(held, padded, rows.dtype)
    found = []
    for row in wanted:
        hits = places.get(row.tobytes())
        if hits is None or len(hits) != 1:
            return None
        found.append(divmod(hits[0], padded.shape[1]))
    return found


def _places(held: torch.Tensor, padded: torch.Tensor, as_type=None) -> dict:
    """{row bytes: [flat indices]} of `padded` (B, Lk, H, D), a view of the frame's `held`, read as `as_type` (its own
    type by default): hashed once per tensor and type."""
    as_type = padded.dtype if as_type is None else as_type
    key = (id(held), None if held.is_inference() else held._version, tuple(padded.shape), as_type)
    cached = _PLACES.get(key)
    if cached is None or cached[0] is not held:
        table = _bytes(padded.detach().to(as_type).reshape(padded.shape[0] * padded.shape[1], -1))
        places: dict = {}
        for index, row in enumerate(table):
            places.setdefault(row.tobytes(), []).append(index)
        if len(_PLACES) > 16:
            _PLACES.clear()
        cached = _PLACES[key] = (held, places)  # (the tensor held: its id stays its own)
    return cached[1]


def _narrowed(rows: torch.Tensor):
    """The narrower float type (bfloat16, float16) every value of the kernel's float32 keys `rows` is exactly one of,
    where they are not all zero; else None."""
    if rows.dtype in (torch.bfloat16, torch.float16):
        return rows.dtype  # (the padded keys wider than the kernel's: cast to its type)
    if rows.dtype != torch.float32 or not bool(rows.any()):
        return None
    for narrow in (torch.bfloat16, torch.float16):
        if bool((rows.to(narrow).to(rows.dtype) == rows).all()):
            return narrow
    return None


def _bytes(rows: torch.Tensor) -> np.ndarray:
    """(n, D) rows as their bytes (n, D * itemsize): bfloat16 and float8 rows, which numpy has no type for, matched too."""
    return rows.cpu().contiguous().view(torch.uint8).numpy()
