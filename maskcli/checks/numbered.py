"""Packed samples numbered in the model call's attention_mask (1, 1, 1, 2, 2, 3, ..., 0 = padding): none may see another.

Packing collators that feed flash-attn's varlen kernel write each packed sample's number into `attention_mask`
instead of ones (axolotl's multipack collator, OpenRLHF's `packing_collate_fn`), and a patched `_get_unpad_data`
turns the numbers into `cu_seqlens`. The numbers are the program's statement of where its samples are: a sample is
a run of one number (a sample is contiguous, so a number met again after another starts another sample), and no
query of one may see a key of another. Two ways that statement is broken:

- the model drops the mask and attends over whole rows (transformers 4.42's flash path keeps a mask only when it holds
  a 0: OpenRLHF 15517919 packed rows with no padding, so every sample saw the ones packed before it);
- the kernel's segments, attended one at a time (a loop of one call per cu_seqlens segment), do not follow the runs:
  OpenRLHF e98d0cbd's rejected samples reused the chosen ones' numbers, and counting tokens per number put two
  samples in one segment.

Read only where the model call's 2-D integer attention_mask holds a number above 1 (a 0/1 padding mask is
arguments.py's). A row whose position_ids restart is said by arguments.py's documents-leak first (engine.SAID_BY).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep, queries
from maskcli.checks.padvalue import padded_with_id
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def samples(top) -> tuple[np.ndarray, np.ndarray] | None:
    """(int64 (B, L) sample of each token, -1 on padding, numbered over the whole batch; the numbers as given) of a
    model call whose attention_mask numbers its packed samples; None where it is a plain 0/1 mask or none."""
    numbers = top.arguments.get("attention_mask")
    if not isinstance(numbers, np.ndarray) or numbers.ndim != 2 or numbers.dtype.kind not in "iu" \
            or numbers.size == 0 or numbers.min() < 0 or numbers.max() < 2 or padded_with_id(top.arguments) is not None:
        return None  # (a mask padded with the pad id: no numbering, padvalue.py)
    for row in numbers:  # (numbered from 1 in each row, a number first met above every one before it: Longformer's
        met = row[row != 0]  # 0 / 1 / 2 = padding / local / global, its global question tokens first, is no numbering)
        if met.size and (met[0] != 1 or (np.diff(np.maximum.accumulate(met)) > 1).any()):
            return None
    begins = np.ones(numbers.shape, dtype=bool)
    begins[:, 1:] = numbers[:, 1:] != numbers[:, :-1]
    begins &= numbers != 0
    labels = np.cumsum(begins.reshape(-1)).reshape(numbers.shape) - 1
    return np.where(numbers != 0, labels, -1), numbers


def _runs(numbers: np.ndarray, b: int) -> str:
    """`[1 x 7, 2 x 7, ...]`: batch row b's numbers as runs."""
    row = numbers[b]
    cut = np.flatnonzero(np.diff(row)) + 1
    parts = np.split(row, cut)
    return "[" + ", ".join(f"{int(p[0])} x {len(p)}" for p in parts[:8]) + (", ..." if len(parts) > 8 else "") + "]"


def _global(cells: np.ndarray, real: np.ndarray, numbers: np.ndarray) -> bool:
    """Whether the tokens numbered 2 of a mask of 0, 1 and 2 are global tokens, as Longformer reads its attention_mask:
    they see every real key of their row and every real query sees them."""
    if numbers.max() != 2:
        return False
    two = numbers == 2
    both = real[:, :, None] & real[:, None, :]
    return bool(((cells | ~both) | ~(two[:, :, None] | two[:, None, :])).all())


def _rows(call, top, labels: np.ndarray, numbers: np.ndarray):
    """Bool (B, L, L) cells where a real query sees a real key of another sample, at a self-attention call over the
    model call's rows from position 0; None where the call is not over them."""
    rows, length = labels.shape
    if call.shape[2] != length or call.shape[3] != length or call.shape[0] != rows:
        return None
    if queries(call, top)[0] != 0:
        return None
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, rows):
        return None
    cells = np.broadcast_to(cells.any(axis=1), (rows, length, length))
    real = labels >= 0
    if _global(cells, real, numbers):
        return None
    return cells & real[:, :, None] & real[:, None, :] & (labels[:, :, None] != labels[:, None, :])


def _segments(calls: list, labels: np.ndarray):
    """(call, its first token among the batch's real tokens flattened, bool (n, n) cells across samples) of each
    one-sequence call of a site that attends the real tokens a segment at a time (the calls' lengths add up to them);
    None where they do not."""
    flat = labels.reshape(-1)
    flat = flat[flat >= 0]
    if len(calls) < 2 or sum(c.shape[2] for c in calls) != len(flat) \
            or any(c.shape[0] != 1 or c.shape[2] != c.shape[3] for c in calls):
        return None
    found, at = [], 0
    for call in calls:
        n = call.shape[2]
        cells = keep(call)
        if cells is None:
            return None
        own = flat[at:at + n]
        found.append((call, at, cells[0].any(axis=0) & (own[:, None] != own[None, :])))
        at += n
    return found


def leaks(run: Run) -> list:
    """A query that sees a key of another packed sample, the samples numbered in the model call's attention_mask."""
    found = []
    for top in run.tops:
        read = samples(top)
        if read is None:
            continue
        labels, numbers = read
        said = f"attention_mask given to {top.where}"
        sites: dict = {}
        for call in run.made_by(top):
            if run.top(call) is top and call.stored is not None and not cross(call):
                sites.setdefault(call.where, []).append(call)
        done = set()
        for calls in sites.values():
            if _segments(calls, labels) is not None:
                continue  # (a segment at a time: said below)
            for call in calls:
                key = (call.mask, call.shape)
                if key in done:
                    continue
                done.add(key)
                across = _rows(call, top, labels, numbers)
                if across is not None and across.any():
                    b, q, k = first_cell(across)
                    found.append((call, Finding("samples-leak", (
                        f"the {said} numbers packed samples (row {b}: {_runs(numbers, b)}), but query {q} of batch row "
                        f"{b} sees key {k} of another sample ({int(across.sum())} such cells): the mask does not keep "
                        f"to them"), expected="each packed sample attends only itself", source=said, cell=(b, q, k))))
        for calls in sites.values():
            segments = _segments(calls, labels)
            for call, at, across in segments or ():
                if across.any():
                    q, k = first_cell(across)
                    found.append((call, Finding("samples-leak", (
                        f"the {said} numbers packed samples (row 0: {_runs(numbers, 0)}), but the segment its calls "
                        f"attend at a time from real token {at} ({call.shape[2]} tokens) spans samples: query {q} sees "
                        f"key {k} of another sample ({int(across.sum())} such cells): the segments are not "
                        f"the runs of the numbers (a number met again after another is another sample)"),
                        expected="one segment per run of a sample number", source=said, cell=(0, q, k))))
    return found


RULES = (
    Rule("samples-leak", "wrong", "steps", "packed samples numbered in the model call's attention_mask (1, 1, 2, ...) "
         "whose mask, or whose per-segment calls, let one sample see another", leaks),
)
