"""A mask's values against the scores' dtype: a finite fill that became -inf, and a bool mask added as 0 and 1.

The trace marks a call whose mask or scores came from a cast or a sum that turned finite values into
-inf (maskcli.trace.overflow: -1e10 cast to float16, finfo.min + finfo.min, finfo(float16).min plus a score
below -16). The program chose a finite fill so that a row masked everywhere stays finite; once it is -inf,
a softmax over that row is NaN, and the NaN reaches every later token through the values. Where the kernel
gives NaN (a softmax row of -inf only) the call is wrong. An overflow inside the mask itself (two masks
added, a mask cast down) that makes no row NaN here is suspicious: the same mask is NaN under a plain
softmax. An overflow in scores + mask that leaves every row a finite cell changes nothing and is not said; nor is
one in a sum of masks one of which keeps a cell in every row (a causal plane: `causal + padding` in finfo.min, old
LLaMA's `_expand_mask + _make_causal_mask`): no row of that sum can be -inf only, whatever the padding.

A bool mask added to the scores (the trace sees the sum: maskcli.trace.overflow) is promoted to 0 and 1: it
masks nothing, whichever way round it was meant.
"""

from __future__ import annotations

from maskcli.checks.context import Run, queries
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def _how(found: dict) -> str:
    """'-1e+10 cast from float32 to float16', 'finfo.min + a score in float16'"""
    value = found.get("value")
    shown = f"{value:.6g}" if isinstance(value, float) else "a finite fill"
    if found.get("op") == "cast":
        return f"{shown} cast from {found.get('from')} to {found.get('dtype')}"
    other = "a score" if found.get("scores") else "another mask"
    if isinstance(found.get("by"), float):  # (a mask scaled or shifted by a number: `(1.0 - mask) * finfo.min`)
        other = f"{found['by']:.6g}"
    return f"{shown} {'+' if found.get('op') == 'sum' else 'x'} {other} in {found.get('dtype')}"


def _fix(found: dict) -> str:
    if found.get("op") == "cast":
        return f"fill with torch.finfo({found.get('dtype')}).min"
    if found.get("scores"):
        return "clamp the sum at finfo.min, or add in float32"
    if found.get("op") == "product":  # (a fill times a fill: `(1.0 - mask) * finfo.min` of a mask already additive)
        return "scale a 0/1 mask by the fill, not one that already holds it: an additive mask converted again?"
    return "combine the masks with torch.where, not +"


def overflowed(run: Run) -> list:
    found, done = [], set()
    for call in run.calls:
        overflow = call.details.get("overflow")
        if not overflow or call.mask in done or call.stored is None:
            continue
        done.add(call.mask)
        nan = overflow.get("rows")  # [b, h, query rows]: a softmax's rows of -inf only (trace/overflow.py)
        where = overflow.get("line", "?")
        source = f"the fill at {where}"
        if nan:
            b, _, rows = nan
            own = queries(call, run.top(call))
            found.append((call, Finding("fill-became-inf", (
                f"{_how(overflow)} became -inf at {where}: query rows {spans(own[rows].tolist())} of batch row {b} are "
                f"-inf only, so softmax gives NaN there ({_fix(overflow)})"),
                expected=f"a finite fill in {overflow.get('dtype')}", source=source, cell=(b, int(own[rows[0]]), 0))))
        elif not overflow.get("scores") and not overflow.get("kept") and call.details.get("fill") not in ("min", "finite"):
            # (not where a mask summed keeps a cell in every row, a causal plane's diagonal: no row of the sum can be
            # -inf only, whatever the padding, so no plain softmax over it is NaN: trace/overflow.py's "kept")
            # (a softmax whose scores hold no -inf: the overflow was clamped back before the kernel, as
            # `(causal + pad).clamp(min=finfo.min)` does, so the mask the kernel applied is finite)
            found.append((call, Finding("fill-became-inf", (
                f"{_how(overflow)} became -inf at {where}: the mask holds -inf where a finite fill was meant, and a "
                f"row of -inf only is NaN under a softmax ({_fix(overflow)})"), severity="suspicious",
                expected=f"a finite fill in {overflow.get('dtype')}", source=source)))
    return found


def bool_added(run: Run) -> list:
    """A bool mask added to the scores before a softmax: True counts as 1 (torch promotes bool to the scores' dtype,
    aten's result_type), so no cell is masked and the kept ones (or the masked ones) get 1 more. Read on every call,
    the cross-attention ones and those of sites that mask nowhere too: a bool added is just what leaves a site masked
    nowhere (VideoSys#116's text cross-attention, its bool padding mask filled with -1e9 on the real tokens)."""
    found, done = [], set()
    for call in sorted((*run.calls, *run.cross, *run.unmasked), key=lambda call: call.index):
        added = call.details.get("bool_added")
        if not added or added.get("line") in done:
            continue
        done.add(added.get("line"))
        where = added.get("line", "?")
        found.append((call, Finding("bool-added", (
            f"a bool mask {tuple(added.get('shape', ()))} is added to the scores at {where}: it adds 0 and 1, so "
            f"nothing is masked (make it 0 and -inf first: torch.where(keep, 0.0, float('-inf')))"), expected="an additive mask: 0 and -inf",
            source=f"the sum at {where}")))
    return found


RULES = (
    Rule("fill-became-inf", "wrong", "call", "a finite fill (-1e10, finfo.min) cast or summed past the compute "
         "dtype's range into -inf, so a row masked everywhere gives NaN", overflowed),
    Rule("bool-added", "wrong", "call", "a bool mask added to the scores: True counts as 1, nothing is masked",
         bool_added),
)
