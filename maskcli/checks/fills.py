"""Fills: what a softmax's fill or an additive mask makes of the masked scores, and fills that do not fit the dtype.

The trace report's rules read a call's details (what trace/scores.py and trace/flex.py recorded about its
scores); inspect's read a tensor's convention. attend's fill that overflows is in stages.py, with its run.
"""

from __future__ import annotations

from maskcli.checks.registry import Rule
from maskcli.conventions import FLOAT_MIN, rounded
from maskcli.text import Finding


def fills(details: dict) -> list[Finding]:
    """What a softmax's finite fill, or an additive mask in its scores, makes of the mask read (masks._finite_fill)."""
    found = []
    if details.get("fill_value") is not None:
        v, by = f"{details['fill_value']:g}", details.get("by_hand")
        found.append(Finding("finite-fill", (
            f"the scores are filled with {v} where masked (a finite fill, as masked_fill(mask == 0, {v})): beside any "
            "ordinary score such a cell gets softmax weight exactly 0, so it is read as masked; but a row filled "
            "everywhere gets uniform weights over every key (softmax of equal values), not NaN and not nothing")
            if by in (None, "exp") else (f"the scores are filled with {v} where masked before {by}, which weighs "
                                        "each score alone (no softmax): such a cell gets weight about 0, so it is "
                                        "read as masked")))
    if details.get("additive"):
        found.append(Finding("additive", (
            "the scores hold values at most -1e4 that are not one constant: an additive mask added to the scores "
            "(BERT's (1 - mask) * -10000 + score), a bias rather than a fill; read as masked where softmax gives "
            "the cell weight exactly 0: a row it lowers everywhere is shifted as a whole and attends to every key")))
    return found


def bias(details: dict) -> list[Finding]:
    """A float attn_mask that adds more than a fill: the mask shown is only its masked cells. Not said of a mask of
    only 0 and 1 (ones-added says what it adds, and it is no bias of positions)."""
    if not details.get("bias") or details.get("zero_one"):
        return []
    return [Finding("bias", (
        "the float attn_mask also adds values other than 0 and a fill (a bias: ALiBi, relative positions): "
        "the mask shown is its cells at -inf or at most -1e4; the rest of what it adds is not shown"))]


def poisoned(details: dict) -> list[Finding]:
    """An additive attn_mask holding NaN or +inf (trace/maskfacts.poison): the kernel's softmax is NaN on each row with one."""
    found = details.get("poison")
    if not found:
        return []
    value, rows = found["value"], found["rows"]
    return [Finding("mask-nan", (
        f"the float attn_mask holds {value} ({found['cells']:,} cell{'s' if found['cells'] != 1 else ''}, in {rows:,} of "
        f"{found['of']:,} query rows over its batch rows and heads): added to the scores, {value} makes the softmax of "
        f"each such row NaN, whatever else the row sees, so the kernel's output there is NaN; the mask shown reads "
        f"those cells as masked (fill with -inf, or torch.finfo(dtype).min, where a cell should be masked)"))]


def score_mod(details: dict) -> list[Finding]:
    """A flex score_mod whose masking was read off its -inf cells with a bias beside it, or could not be read."""
    read = details.get("score_mod_read")
    if not read or read == "read: its -inf cells":  # (flex.py: a score_mod's masking is read off its -inf cells)
        return []
    name = details.get("score_mod_name", "?")
    return [Finding("score-mod", (
        f"the score_mod {name} also adds a bias where it does not mask: the mask shown is the cells it sets to -inf"
        if read.startswith("read") else f"the score_mod {name} was {read}: the mask shown leaves out any cell it "
        "masks (sets to -inf)"))]


def sentinel_overflow(dtype: str, sentinel: float | None) -> list[Finding]:
    """A tensor's lowest finite fill (`sentinel`, of a tensor stored as `dtype`) that is -inf in float16 or bfloat16."""
    if sentinel is None:  # (-inf needs no check: it is -inf in every dtype)
        return []
    found = []
    for name in ("float16", "bfloat16"):
        if dtype == name or sentinel >= FLOAT_MIN[name]:
            continue
        if rounded(sentinel, name) == float("-inf"):
            found.append(Finding(
                "sentinel-overflow",
                f"the fill value {sentinel:.6g} does not fit {name} (lowest {FLOAT_MIN[name]:.6g}): "
                f"cast to {name} it becomes -inf, so a fully masked row gives NaN "
                f"(maskcli convert --to min --dtype {name} writes finfo({name}).min)",
            ))
    return found


def ones_masked(convention) -> list[Finding]:
    """An integer mask (inspect's convention) whose 1s mark the masked cells."""
    if convention.name != "int" or convention.ones_mean != "masked":
        return []
    return [Finding(
        "ones-masked",
        "1 marks the masked cells here: masked_fill(mask.bool(), -inf) applies it right, "
        "masked_fill(mask == 0, -inf) applies it backwards",
    )]


def group_scores(g) -> list[Finding]:
    """What a trace group's first call recorded of its scores (checks/grouped.py): a bias beside the fill, a finite
    fill or an additive mask, NaN or +inf in the mask, a score_mod that adds more than its masking."""
    details = g.first.details
    return bias(details) + fills(details) + poisoned(details) + score_mod(details)


def tensor_fills(analysis, count: int | None = None) -> list[Finding]:
    """A tensor a user gave (inspect's Analysis, taken as it comes): a fill that overflows float16 or bfloat16, then an
    integer mask whose 1s mark the masked cells (`count`, the model's heads, is the shape rule's)."""
    from maskcli.tensorfile import dtype_name

    return sentinel_overflow(dtype_name(analysis.tensor), analysis.convention.sentinel) + ones_masked(analysis.convention)


RULES = (
    Rule("finite-fill", "note", "call", "scores filled with a finite value where masked: a row filled everywhere gets "
         "uniform weights", group_scores, "scores"),
    Rule("additive", "note", "call", "an additive mask added to the scores rather than a fill", group_scores, "scores"),
    Rule("bias", "note", "call", "a float mask that also adds a bias (ALiBi, relative positions)", group_scores, "scores"),
    Rule("mask-nan", "wrong", "call", "a float attn_mask holding NaN or +inf: the kernel's output is NaN on every row "
         "holding one", group_scores, "scores"),
    Rule("score-mod", "note", "call", "a flex score_mod that also adds a bias, or whose masking could not be read off "
         "its -inf cells", group_scores, "scores"),
    Rule("sentinel-overflow", "wrong", "call", "a fill value that is -inf in float16 or bfloat16, so a fully masked row "
         "gives NaN", tensor_fills, "tensor"),
    Rule("ones-masked", "note", "call", "an integer mask whose 1s mark the masked cells", tensor_fills, "tensor"),
)
