"""A mask written into the scores with a fill of about zero: the cells the program masks keep their softmax weight.

trace/weakfill.py records at a softmax the cells its scores had replaced before it by `torch.where(mask, scores,
fill)` or `scores.masked_fill(mask, fill)` with a fill at most 1 from 0 (details["weak_fill"]), where the mask
broadcasts to the scores (no function of their values) and the softmax sees some of those cells. The program states
there which keys each query must not read (a causal triangle, the observed-values key mask); a fill of +1e-9 or 0 is an
ordinary score, so softmax gives those cells a weight like any other and the mask masks nothing: wrong
(awslabs/gluonts#1401: the TFT's decoder filled with +1e-9 instead of -1e9, future steps and unobserved history seen).
A low fill lifted back to such a score before the softmax by a bounded map (trace/undone.py: tanh after the -inf fill,
zinengtang/Perceiver_VL#2) masks nothing alike.
Quiet on a fill of -1e4 or less (fills.py reads those), on cells another mask hides from the softmax (a masked_fill
of -inf beside it), on weights multiplied by a 0/1 mask after the softmax (trace/after.py's masked_after), and on a mask made from the scores themselves (a clamp, a NaN guard).
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def weak_fill(run: Run) -> list:
    """A softmax whose scores had cells the program masked replaced by a fill of about zero, seen by the softmax."""
    found, done = [], set()
    for call in [*run.calls, *getattr(run, "unmasked", ()), *run.cross]:  # (a fill that masks nothing leaves its
        # site unmasked; a cross-attention's key padding is masked by a fill as a self-attention's is)
        weak = call.details.get("weak_fill")
        if not weak or (call.where, call.shape) in done or call.details.get("masked_after"):
            continue  # (a 0/1 product after the softmax masks those cells: AllenNLP's masked_softmax, renormalised)
        done.add((call.where, call.shape))
        b, h, q, k = weak["cell"]
        undone = weak.get("undone")
        if undone:  # (a low fill lifted back by a bounded map: trace/undone.py)
            said = (f"filled with {undone['fill']:g} where the program masks them, then torch.{undone['by']} lifted "
                    f"the fill to {weak['value']:g} at the softmax, a score like any other")
            fix = f"apply {undone['by']} before the fill"
        else:
            said = (f"replaced by {weak['value']:g} where the program masks them (torch.where / masked_fill before "
                    "the softmax), a fill of about zero")
            fix = "fill with -inf or finfo.min"
        found.append((call, Finding("fill-masks-nothing", (
            f"{call.where}'s scores had {weak['cells']} cells {said}: softmax weighs them like any score, so the mask "
            f"masks nothing (batch row {b}, head {h}, query {q} reads key {k}); {fix}"),
            expected="masked cells weigh 0", source=f"a fill of {weak['value']:g} written into the scores",
            cell=(b, q, k))))
    return found


RULES = (
    Rule("fill-masks-nothing", "wrong", "call", "a mask written into the scores with torch.where / masked_fill and a "
         "fill of about zero (+1e-9 for -1e9, 0 for -inf): the masked cells keep their softmax weight", weak_fill),
)
