"""A model call handed a padding mask that its own input's zeros confirm, whose attention still sees the padding.

The model call was handed a 0/1 mask named as a padding mask (`mask`, `input_mask`, `attention_mask`: 1 = real;
`*padding_mask`, `*pad_mask`: True = padding), 1-D over the samples or one row per batch row, beside a float input
whose samples are exactly 0 on every sample the mask calls padding, in one run at an edge of each row, and not all 0
on the samples it calls real (trace/tops.py's `padded_input`): the program states that padding twice, in the mask it
built and in the data it padded with zeros. Where a self-attention the call made over those samples, or over patches
of them (S samples in L keys of S / L samples each, a time-series or image patching; the batch folded with its
channels, either way round), lets a real query see a key made of padding alone, the mask never reached the attention
(sktime#10685: MomentFMForecaster handed its padding mask as MOMENT's `mask=`, read only for reconstruction, and
forecasting defaulted `input_mask` to ones: every patch attended the zero padding).

Zeros alone say nothing (silence, a black border); a mask alone may be another mask (a pretraining mask over real
samples, which are not 0). Where a fold or a patching may be read several ways, it speaks only where every reading is
seen through. Left alone: cross-attention, keys that mix real and padding samples, a mask of other values, and where
the padded input is the memory of a cross-attention the call made, its decoder's self-attention (other tokens).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.blockpad import not_heads
from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.held import edge_runs
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def _stated(top) -> tuple[str, np.ndarray, str] | None:
    """(mask name, bool (B, S) real samples, input name) where the mask's padding is the input's zero run; None else."""
    said = top.arguments.get("padded_input")
    if said is None:
        return None
    name, values, source, zero = said
    real = values.astype(bool)
    if name.rstrip('"]').endswith(("padding_mask", "pad_mask")):  # (a batch dict's field: batch["pad_mask"])
        real = ~real
    if real.ndim == 1:
        real = real[None, :]
    if real.shape[0] not in (1, zero.shape[0]) or real.shape[1] != zero.shape[1]:
        return None
    real = np.broadcast_to(real, zero.shape)
    if not edge_runs(real, right_only=False):
        return None
    for b in np.flatnonzero(~real.all(axis=1)):
        if not zero[b][~real[b]].all() or zero[b][real[b]].all():
            return None  # (the mask's padding is not the data's zeros: another mask, or the data not padded)
    return name, real, source


def _keys(real: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(real keys, padding keys), bool (B, L) each, where the S samples make `length` keys of S / L samples each."""
    samples = real.shape[1]
    if samples % length:
        return None
    patches = real.reshape(real.shape[0], length, samples // length)
    return patches.all(axis=2), ~patches.any(axis=2)


def zero_padding_attended(run: Run) -> list:
    """Self-attention calls whose real queries see keys of samples the model call's mask and input's zeros call padding."""
    found, done = [], {}
    square = [call for call in run.unmasked if call.shape[2] == call.shape[3] > 1]  # (an all-ones mask masks nowhere)
    for call in [*run.calls, *square]:
        top = run.top(call)
        if top is None or "padded_input" not in top.arguments or call.stored is None or cross(call) \
                or call.shape[2] != call.shape[3]:
            continue
        key = (call.mask, call.shape, id(top))
        if key not in done:
            done[key] = None if _decoder_side(run, call, top) else _finding(call, top)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _decoder_side(run: Run, call, top) -> bool:
    """The padded input is a memory this model call's cross-attention reads (an encoder's states handed to a decoder,
    zeroed at the padding): its self-attention calls are then over other tokens unless they are over the samples
    themselves, outside a module named a decoder."""
    samples = top.arguments["padded_input"][3].shape[1]
    if not any(run.top(other) is top and other.shape[3] == samples for other in run.cross):
        return False
    return call.shape[3] != samples or "decoder" in call.where.lower()


def seen_through(cells: np.ndarray, keys: tuple, folds: list) -> np.ndarray | None:
    """Bool (rows, L, L) under the first of `folds` (each call row's batch row): a real query that sees a padding key,
    for `keys` (real, padding), bool (B, L) each, and the call's keep `cells` (rows or 1, H, L, L); None where some
    reading of the fold sees none (the mask keeps to the padding under it)."""
    rows, length = len(folds[0]), cells.shape[-1]
    cells = np.broadcast_to(cells.any(axis=1), (rows, length, length))
    first = None
    for fold in folds:
        bad = cells & keys[0][fold][:, :, None] & keys[1][fold][:, None, :]
        if not bad.any():
            return None
        first = first if first is not None else bad
    return first


def _finding(call, top) -> Finding | None:
    stated = _stated(top)
    rows, length = call.shape[0], call.shape[3]
    if stated is None:
        return None
    name, real, source = stated
    keys = _keys(real, length)
    cells = keep(call)
    if keys is None or cells is None or cells.shape[0] not in (1, rows) or not_heads(call):
        return None  # (an axis of blocks where heads were read: its keys are one block's, no patches of the samples)
    if call.shape[1] == 1 and rows > 1 and call.details.get("stated_heads") == rows:
        return None  # (its rows may as well be one sequence's heads, as many as its module states: (H, L, L) scores
        # of a packed sequence's `"xhd,yhd->hxy"`, MoBA's naive reference; no reading of batch rows is sure)
    size = real.shape[0]
    if rows == size:
        folds = [np.arange(rows)]
    elif rows % size == 0:  # (the batch folded with n other rows each: channels, by repeat_interleave or by repeat)
        n = rows // size
        folds = [np.arange(rows) // n, np.arange(rows) % size]
    else:
        return None
    first = seen_through(cells, keys, folds)
    if first is None:
        return None
    b, q, k = first_cell(first)
    per = real.shape[1] // length
    row = int(folds[0][b])
    pads = spans([int(s) for s in np.flatnonzero(~real[row])])
    made = f"sample {k}" if per == 1 else f"samples {k * per}-{(k + 1) * per - 1}"
    return Finding("zero-padding-attended", (
        f"batch row {b}: query {q} sees key {k}, made of {made}, padding: the `{name}` handed to {top.where} calls "
        f"samples {pads} of that row padding and its `{source}` holds them as exact zeros ({int(first.sum())} such "
        f"cells): the padding mask "
        f"never reached this attention (handed to an argument that does not mask, or replaced by a default)"),
        expected="no real query sees a key of padding samples", source=f"{name} of {top.where}", cell=(b, q, k))


RULES = (
    Rule("zero-padding-attended", "wrong", "call", "a real query that sees a key made only of samples the model call's "
         "padding mask calls padding and its input holds as exact zeros (a padding mask handed to an argument that "
         "does not mask: sktime#10685)", zero_padding_attended),
)
