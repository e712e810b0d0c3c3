"""A finite fill or an additive mask in a softmax's scores, and the cells it masks (trace/masks.py's softmax reader).

A finite fill is one constant at most -1e4 (masked_fill(mask == 0, -1e9)), or a whole number nearer zero that the
softmax turns to weight exactly 0 (icefall's -1000.0: _round_fill); several such values are an additive mask
added to the scores (BERT's (1 - mask) * -10000 + score), read as masked where softmax gives a cell weight exactly 0.
That reading holds where the scores themselves are ordinary (a few tens apart): softmax then zeroes only what the mask
lowered. Scores that lie 1e4 and more apart (a converted checkpoint's outlier activations, unscaled q @ kᵀ) zero cells
of their own: a cell whose weight is 0 while its own score is above any fill is hidden by the other scores of its
row, not by a mask (details["scores_hide"]: the largest score's magnitude). Such a reading is the program's effective
attention, not its mask: the cells it hides say nothing of padding (checks/heads.py, checks/arguments.py).
"""

from __future__ import annotations

import torch

FILL_AT_MOST = -1e4  # exp(v - s) is exactly 0 once v - s < -103.3 in float32 and bfloat16 (the smallest subnormal,
# 1.4e-45, is e^-103.3) and < -17.3 in float16: so v <= -1e4 gets weight 0 beside any score above -9896, any ordinary one


def finite_fill(scores: torch.Tensor, lowest: float, details: dict) -> torch.Tensor:
    """The cells a finite fill masks (masked_fill(mask == 0, -1e9), the Annotated Transformer's): values at most -1e4
    (not -inf, not the dtype's lowest) that are all one exact constant are a fill, and the cells equal to it masked.
    Several such values are an additive mask added to the scores (BERT's (1 - mask) * -10000 + score): no cell equals
    a fill, so the cells are read as masked where softmax gives them weight exactly 0, as the program computes, and a
    row lowered everywhere (each of its scores -5000 or less) beside one that is not as masked whole, as a row filled
    everywhere is."""
    near = (scores <= FILL_AT_MOST / 2) & (scores != lowest) & torch.isfinite(scores)  # (-1e4 + a score: either side;
    low, values = near & (scores <= FILL_AT_MOST), scores[near]  # an additive mask's cells may all sit above -1e4)
    if not len(values):
        round_fill = _round_fill(scores, lowest)
        if round_fill is not None:
            details["fill_value"] = float(scores[round_fill][0])
            details["fill"] = details["fill"] or "finite"
            return round_fill
    if not len(values) or bool((values == values[0]).all()):
        if bool(low.any()):
            details["fill_value"] = float(values[0])
            details["fill"] = details["fill"] or "finite"
        return low
    details["additive"] = True  # (-10000 + a score may sit just above -1e4: every cell's weight decides)
    zero = torch.softmax(scores, dim=-1) == 0
    whole = (near | ~torch.isfinite(scores) | (scores == lowest)).all(dim=-1, keepdim=True)
    if scores.dim() >= 2:  # (only beside a row of the same plane it does not lower whole: a plane lowered everywhere,
        whole = whole & ~whole.all(dim=-2, keepdim=True)  # an MSA's padding sequence, OpenFold's, stays shifted whole)
    if bool(whole.any()):  # (a row the mask lowers everywhere is shifted as a whole: uniform weights over every key,
        zero = zero | whole  # read as a finite fill's row filled everywhere is, masked: t5x's target padding rows)
    if bool((zero & (scores > FILL_AT_MOST / 2)).any()):  # (a weight of 0 on a score no fill lowered)
        finite = scores[torch.isfinite(scores) & (scores != lowest)]
        details["scores_hide"] = float(finite.abs().max())
    return zero


ROUND_FILL_AT_MOST = -100.0  # a round fill above -1e4 (icefall's Zipformer: masked_fill(mask, -1000.0))


def _round_fill(scores: torch.Tensor, lowest: float) -> torch.Tensor | None:
    """The cells of a fill above -1e4 (-1000.0, -100.0): the scores' least finite value, a whole number at most -100, held
    by two cells or more, each given weight exactly 0 by the softmax (or in a row filled whole); else None. A q @ kᵀ
    score is no whole number repeated, so such cells are a mask's; a fill that leaves its cells some weight masks
    nothing fully and is not read as one."""
    finite = torch.isfinite(scores) & (scores != lowest)
    if not bool(finite.any()):
        return None
    least = float(torch.where(finite, scores, torch.inf).amin())
    if least > ROUND_FILL_AT_MOST or least != round(least):
        return None
    low = scores == least
    if int(low.sum()) < 2:
        return None
    whole = (low | ~finite).all(dim=-1, keepdim=True)
    zero = torch.softmax(scores.float(), dim=-1) == 0
    if not bool((~low | zero | whole).all()):
        return None
    return low
