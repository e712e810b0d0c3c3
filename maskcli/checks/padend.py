"""A padding mask built at the wrong end of the batch its own input pads with zeros.

The program states its padding twice where it pads its values with zeros and builds a 0/1 mask beside them
(trace/padend.py: details["zero_samples"], a float input the frame that holds a keep or padding mask holds over the
same samples). Where, in every row the mask pads, it hides n samples at one edge that are not all 0 and the input holds
the n samples at the other edge as exact zeros (that the mask keeps), the mask marks the wrong end: the zeros are the
padding, the samples it hides are the row's data. Said where a self-attention over those samples (or over patches of
S / L samples each, the batch folded with its channels, every way round seen through) lets a query made of data see a
key made of the zero padding alone: moment-research#3, `upsample_timeseries(direction="forward")` right-pads the
series with `np.pad(..., (0, n))` and zeroes `input_mask[:n]`, the start, so MOMENT's T5 encoder masks real patches
and attends the padded tail.

Quiet where the input is 0 on every sample the mask keeps, in every row, and some row keeps more samples than it hides
(a row the mask keeps whole, all zeros): no data there to be padded at the other end, but a tensor multiplied by the
padding flag itself (speechbrain#2276: FastSpeech2's positional embedding times `srcmask`, True on padding, zero at
every real position). Quiet where a padded row's hidden samples are all 0 (the padding the mask means, or zeros on both ends), where the
zeros at the other edge are fewer than the samples hidden (a mask of other samples: a pretraining or forecast-horizon
mask over real data), where any padded row reads otherwise, on cross-attention, and where the attention hides the
zero keys anyway.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.padded import _keys, seen_through
from maskcli.checks.registry import Rule
from maskcli.checks.subsampled import _folds
from maskcli.text import Finding, spans


def mirrored(real: np.ndarray, zero: np.ndarray) -> np.ndarray | None:
    """Bool (B, S): the samples the input's zeros pad, where in every row the mask `real` pads it hides an edge run of
    n samples not all 0 and the input holds the n samples at the other edge as 0 (and those rows alone); None else."""
    samples = real.shape[1]
    if not (real & ~zero).any() and (real.sum(axis=1) > (~real).sum(axis=1)).any():
        return None  # (0 on every sample the mask keeps, in a row that keeps more than it hides: no data padded at the
        # other end, the mask's complement multiplied in; speechbrain#2276's positions times the padding flag)
    padding = np.zeros_like(real)
    for b in np.flatnonzero(~real.all(axis=1)):
        n = int((~real[b]).sum())
        at_start = not real[b, :n].any()
        if not at_start and real[b, samples - n:].any():
            return None  # (hidden samples in no edge run: another mask)
        hidden, other = (slice(0, n), slice(samples - n, samples)) if at_start else \
            (slice(samples - n, samples), slice(0, n))
        if zero[b, hidden].all() or not zero[b, other].all():
            return None  # (the mask hides zeros, or the other edge is data: no padding stated twice the other way)
        padding[b, other] = True
    return padding if padding.any() else None


def wrong_end(run: Run) -> list:
    found, done = [], {}
    for call in run.calls:
        said = call.details.get("zero_samples")
        if not said or call.stored is None or cross(call) or call.shape[2] != call.shape[3]:
            continue
        key = (call.mask, call.shape, id(said))
        if key not in done:
            done[key] = next((f for f in (_finding(call, one) for one in said) if f is not None), None)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call, said: dict) -> Finding | None:
    padding = mirrored(np.asarray(said["real"], dtype=bool), np.asarray(said["zero"], dtype=bool))
    rows, length = call.shape[0], call.shape[3]
    keys = None if padding is None else _keys(~padding, length)
    cells = keep(call)
    if keys is None or cells is None or cells.shape[0] not in (1, rows) or rows % padding.shape[0]:
        return None
    folds = _folds(padding.shape[0], rows)
    first = seen_through(cells, keys, folds)
    if first is None:
        return None  # (a reading under which the attention hides the zero padding)
    b, q, k = first_cell(first)
    per = padding.shape[1] // length
    row = int(folds[0][b])
    made = f"sample {k}" if per == 1 else f"samples {k * per}-{(k + 1) * per - 1}"
    hidden = spans([int(s) for s in np.flatnonzero(~np.asarray(said["real"], dtype=bool)[row])])
    zeros = spans([int(s) for s in np.flatnonzero(padding[row])])
    return Finding("padding-mask-wrong-end", (
        f"batch row {b}: query {q} sees key {k}, made of {made}, which `{said['input']}` of {said['held']} holds as "
        f"exact zeros at the row's other end (samples {zeros}), while `{said['mask']}` of {said['where']} calls samples "
        f"{hidden} padding, which hold data ({int(first.sum())} such cells): the padding mask marks the wrong end of "
        f"the padded row (its run as long as the zeros)"),
        expected="the mask hides the samples the input pads with zeros",
        source=f"{said['input']} of {said['held']}, {said['mask']} of {said['where']}", cell=(b, q, k))


RULES = (
    Rule("padding-mask-wrong-end", "wrong", "call", "a padding mask that hides a row's data at one end while its input "
         "holds as many samples at the other end as exact zeros, which the attention keeps (moment-research#3)",
         wrong_end),
)
