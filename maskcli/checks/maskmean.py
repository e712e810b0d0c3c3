"""A mean over a batch's positions whose sum counts positions its divisor, the mask's sum, leaves out.

`x.sum(dim) / mask.sum(-1)` states which positions of each row the mean is over: the divisor counts those the 0/1
mask keeps. Where the summed tensor is not 0 at a position the mask leaves out (trace/maskmean.py: the division
recorded on the last attention call made, details `masked_mean`), the sum runs over positions the count does not hold:
the mean is inflated by the masked positions' values (rerankers#75: ColBERT's MaxSim summed over the query's [MASK]
augmentation tokens, whose attention_mask is 0, and divided by `q_mask.sum()`). Quiet where the summed tensor is 0 at
every masked position (`(x * mask).sum(dim)`: the fix), and on a mask that keeps a row whole or none of it.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.real import by_row, resolve
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def masked_mean(run: Run) -> list:
    """The masked means a trace recorded (details `masked_mean`): wrong, each."""
    found = []
    for call in [*run.calls, *run.cross, *run.unmasked]:
        for mean in call.details.get("masked_mean") or ():
            row, positions = mean["row"], mean["positions"]
            shown = ", ".join(str(p) for p in positions[:8]) + (", ..." if len(positions) > 8 else "")
            found.append((call, Finding("mean-counts-masked", (
                f"a sum over axis {mean['axis']} of a {tuple(mean['summed'])} tensor is divided by a {tuple(mean['mask'])} "
                f"mask's sum{' (' + mean['how'] + ')' if mean.get('how') else ''}, but batch row {row} sums values at "
                f"position{'s' if len(positions) > 1 else ''} {shown} "
                f"the mask leaves out of its count: the mean counts masked positions (the sum not multiplied by the "
                f"mask?)"), expected=f"0 summed at row {row}'s masked positions, as the divisor counts them",
                source="the divisor: a mask's sum", cell=(row, positions[0], positions[0]))))
    return found


def mean_padding(run: Run) -> list:
    """Means over positions zeroed at the padding of the attention call before them (details `zero_mean`): wrong."""
    found = []
    for call in [*run.calls, *run.unmasked]:
        for mean in call.details.get("zero_mean") or ():
            finding = _counted(run, call, mean)
            if finding is not None:
                found.append((call, finding))
                break
    return found


def _counted(run: Run, call, mean: dict):
    zeroed = mean["zeroed"]
    rows, length = zeroed.shape
    cells = keep(call)
    if cells is None or call.shape[3] != length or call.shape[0] != rows or cells.shape[0] not in (1, rows):
        return None
    seen = by_row(cells, rows)
    said = resolve(call, run.top(call), seen)  # (the model call's statement; else the keys no query of the row sees)
    real = said.keys if said.source is not None else seen.any(axis=1)
    both = real.any(axis=1) & ~real.all(axis=1)
    if not zeroed.any():  # (nothing zeroed: the pads' own values averaged in, where the model call states them, or
        # its attention hides a padded tail of each row from every query, the longest row whole)
        if said.source is not None:
            return _over_padding(mean, real, both)
        return _over_padding(mean, real, both, *HIDDEN) if _tails(real) else None
    exact = both & (zeroed == ~real).all(axis=1)
    if not exact.any():
        return None
    row = int(np.flatnonzero(exact)[0])
    pads = np.flatnonzero(~real[row])
    shown = ", ".join(str(p) for p in pads[:8]) + (", ..." if len(pads) > 8 else "")
    return Finding("mean-counts-padding", (
        f"batch row {row}: a mean over axis 1 of a {tuple(mean['shape'])} tensor divides by all {length} positions, "
        f"but the tensor is 0 at exactly the position{'s' if len(pads) > 1 else ''} {shown} the attention call before "
        f"it masks as padding ({len(pads)} of {length}): the mean counts the padding it zeroed (divide the sum by the "
        f"mask's sum)"), expected=f"row {row}'s sum divided by its {length - len(pads)} real positions",
        source="the positions zeroed before the mean: the attention call's padding", cell=(row, int(pads[0]), int(pads[0])))


def _tails(real: np.ndarray) -> bool:
    """Each row's keys no query sees are one run at its end, the runs differ and some row has none: a batch padded on
    the right to its longest row (Presto's encoder, its masked tokens dropped and the rest padded, blind-lr)."""
    if real.shape[0] < 2:
        return False
    counts = real.sum(axis=1)
    tails = (np.arange(real.shape[1])[None, :] < counts[:, None]) == real
    return bool(tails.all() and (counts == real.shape[1]).any() and (counts < real.shape[1]).any() and counts.min() > 0)


STATED = ("model call states and the attention call before it masks", "the model call's stated padding")
HIDDEN = ("model's attention hides from every query", "the padding its attention hides")  # (what says it, the source)


def _over_padding(mean: dict, real: np.ndarray, both: np.ndarray, said: str = STATED[0], source: str = STATED[1]):
    if not both.any():
        return None
    row = int(np.flatnonzero(both)[0])
    length, pads = real.shape[1], np.flatnonzero(~real[row])
    shown = ", ".join(str(p) for p in pads[:8]) + (", ..." if len(pads) > 8 else "")
    return Finding("mean-over-padding", (
        f"batch row {row}: a mean over axis 1 of a {tuple(mean['shape'])} tensor averages all {length} positions, the "
        f"padding at position{'s' if len(pads) > 1 else ''} {shown} among them ({len(pads)} of {length}), which the "
        f"{said}: the pooled vector takes the pads' values and "
        f"changes with the batch's padded length (sum over the real positions, divide by their count)"),
        expected=f"row {row}'s mean over its {length - len(pads)} real positions",
        source=source, cell=(row, int(pads[0]), int(pads[0])))


RULES = (
    Rule("mean-counts-masked", "wrong", "call", "a sum over a batch's positions divided by a 0/1 mask's sum over them "
         "(a masked mean) whose summed values are not 0 at positions the mask leaves out", masked_mean),
    Rule("mean-counts-padding", "wrong", "call", "a mean over a batch's positions of values zeroed at exactly the "
         "positions the attention call before it masks as padding (the padded length counted)", mean_padding),
    Rule("mean-over-padding", "wrong", "call", "a mean over a batch's positions, nothing zeroed, that averages in the "
         "padding its model call states and its attention masks (the pooled vector changes with the padded length)",
         mean_padding),
)
