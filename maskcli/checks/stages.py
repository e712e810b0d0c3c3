"""Attention run through a mask on a device (attend, verify): rows that see no key and what the fill made of them,
queries that see later keys, scores that are not finite, weight rows that do not sum to 1, a fill that overflows.

These read torch tensors where they are (attention/stages.py's Stages); torch is imported inside each function, as
the rest of this package needs none. attention/findings.py asks the registry for them (given `stages`, a run; given
`mask`, the mask alone: mask_findings, the check rows.py's fully-masked and sees-later rules have for it).
"""

from __future__ import annotations

from maskcli.checks.registry import Rule
from maskcli.text import Finding, plane_text, spans

RAW_MATRICES = ("tril", "triu")  # causal only by their diagonal: where later keys are worth a word


def expects_causal(mask) -> bool:
    """True when every kind of the mask means no query sees a later key (tril/triu by their usual diagonal)."""
    from maskcli.terms import terms

    if mask.expression is None:
        return False
    return all(term.kind.causal or term.kind.name in RAW_MATRICES for term in terms(mask.expression))


def raw_matrix(mask) -> bool:
    return any(name in RAW_MATRICES for name in mask.kinds)


def _rows(rows: list[int], verb: str) -> str:
    """'query row 2 sees' / 'query rows 0-2 see'."""
    if len(rows) == 1:
        return f"query row {rows[0]} {verb}s"
    return f"query rows {spans(rows)} {verb}"


def _rows_by_slice(rows, q_offset: int):
    """Yield (b, h, [absolute query positions]) for each (b, h) with a True row."""
    import torch

    rows = rows.cpu()  # (B, H, Lq) flags: one copy off the device, not one per slice
    for b, h in torch.nonzero(rows.any(dim=-1)).tolist():
        yield b, h, [q_offset + i for i in torch.nonzero(rows[b, h]).flatten().tolist()]


def fully_masked_rows(keep):
    """Bool (B, H, Lq): rows that see no key at all."""
    return ~keep.any(dim=-1)


def mask_findings(keep, mask) -> list[Finding]:
    """Findings about the mask alone: rows that see nothing, queries that see later keys (`keep`: bool (B, H, Lq, Lk)
    on a device, the dimensions the mask only broadcasts over cut to size 1, so that they are looked at once).
    """
    findings = []
    for b, h, rows in _rows_by_slice(fully_masked_rows(keep), mask.q_offset):
        findings.append(Finding("fully-masked", f"{_rows(rows, 'see')} no key at all{plane_text(b, h, keep.shape)}"))
    findings += later_key_findings(keep, mask)
    return findings


def later_key_findings(keep, mask) -> list[Finding]:
    """Queries that see keys after their own position, where every kind of the mask means they should not."""
    import torch

    findings = []
    if not expects_causal(mask) or mask.causal:
        return findings
    q_offset, k_offset = mask.q_offset, mask.kv_offset
    later = torch.triu(keep, diagonal=q_offset - k_offset + 1)  # cells with absolute kv > absolute q
    if not later.any():
        return findings
    for b, h, rows in _rows_by_slice(later.any(dim=-1), q_offset):
        first = rows[0]
        keys = [k_offset + k for k in torch.nonzero(later[b, h, first - q_offset]).flatten().tolist()]
        hint = " (is tril/triu read with the wrong --means?)" if raw_matrix(mask) else ""
        findings.append(
            Finding(
                "sees-later",
                f"{_rows(rows, 'see')} later keys{plane_text(b, h, keep.shape)}, which {mask.text} "
                f"should not allow: query {first} sees keys {spans(keys)}{hint}",
            )
        )
    return findings


def run_findings(stages, mask, keep, fill: float | None) -> list[Finding]:
    """Findings about a run (attention.stages.Stages): what fully masked rows turned into, rows that do not sum to 1,
    scores that are not finite, fill overflow. `keep`: stages.keep with the dimensions the mask only broadcasts over
    cut to size 1 (a view: attention.stages.compact); `fill`: the value a -1e9 fill wrote, as the dtype stores it
    (attention.stages.fill_value), else None.

    The work stays on the compute device; only a few numbers and per-row flags come back to the host.
    """
    import torch

    dtype = stages.scaled.dtype
    findings: list[Finding] = []
    if stages.fill == "-1e9" and fill == float("-inf"):
        findings.append(
            Finding(
                "fill-overflow",
                f"fill -1e9 does not fit {_name(dtype)} (lowest {torch.finfo(dtype).min:.6g}) "
                "and became -inf, so a fully masked row turns to NaN; use --fill min",
            )
        )
    sums = stages.weights.sum(dim=-1, dtype=torch.float32)
    tolerance = max(1e-3, 4 * torch.finfo(stages.weights.dtype).eps)  # bfloat16 keeps under 3 digits
    low, high = torch.aminmax(sums)
    rows_sum_to_one = 1 - tolerance <= float(low) and float(high) <= 1 + tolerance  # NaN fails both
    # under min and -1e9 they are uniform and sum to 1; a safe softmax (SDPA) makes them 0
    empty_rows_are_nan = stages.fill in ("-inf", "multiply") and stages.pipeline.softmax != "safe"
    q_offset = mask.q_offset
    if rows_sum_to_one and empty_rows_are_nan and (mask.causal or not expects_causal(mask)):
        # The common case, settled by that one reduction: no row is NaN, so none sees no key,
        # and the mask either never lets a query see a later key or does so by design.
        return findings
    findings += later_key_findings(keep, mask)
    if rows_sum_to_one and (empty_rows_are_nan or bool(keep.any(dim=-1).all())):
        return findings
    seen = keep.any(dim=-1)
    findings += _empty_row_findings(stages, keep, ~seen, q_offset)
    explained, non_finite = _non_finite_findings(stages, keep, q_offset)
    findings += non_finite
    sums_ok = (sums - 1).abs() <= tolerance  # False for NaN
    off = ~sums_ok & seen & ~explained
    if not off.any():
        return findings
    if stages.dropout > 0:
        findings.append(Finding("row-sum", f"with --dropout {stages.dropout} the weight rows no longer sum to 1 (kept weights are scaled by 1/(1-p))"))
    else:
        for b, h, rows in _rows_by_slice(off, q_offset):
            findings.append(Finding("row-sum", f"the weights of query row{'s' if len(rows) > 1 else ''} {spans(rows)} do not sum to 1{plane_text(b, h, off.shape)}"))
    return findings


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _empty_row_findings(stages, keep, empty, q_offset: int) -> list[Finding]:
    """Rows that see no key, and what the fill made of them: NaN, uniform weights, or something else."""
    import torch

    if not bool(empty.any()):
        return []
    # what each row became, as per-row flags computed on the device
    nan_rows = torch.isnan(stages.weights).all(dim=-1).cpu()
    zero_rows = (stages.weights == 0).all(dim=-1).cpu()
    uniform_rows = ((stages.weights.float() - 1.0 / keep.shape[-1]).abs() <= 1e-3).all(dim=-1).cpu()
    findings = []
    dtype = stages.scaled.dtype
    for b, h, rows in _rows_by_slice(empty, q_offset):
        # a mask that broadcasts over batch or heads is looked at once, through the first of them
        at = (b if keep.shape[0] > 1 else 0, h if keep.shape[1] > 1 else 0, [row - q_offset for row in rows])
        severity = "note"  # as in a trace: wrong where the rows turn into NaN, a note where they get 0 or uniform weights
        if bool(nan_rows[at].all()):
            severity = "wrong"
            effect = "the weights and outputs there are NaN (softmax of a row with no finite score, or 0/0)"
            if _min_is_infinite_in_softmax(stages):
                effect = (
                    f"the weights and outputs there are NaN, because finfo({_name(dtype)}).min is -inf in the float32 "
                    "softmax (Hugging Face's eager attention gives the same)"
                )
        elif bool(zero_rows[at].all()) and stages.pipeline.softmax == "safe":
            effect = "the weights and outputs there are 0 (a safe softmax, as SDPA's math backend gives)"
        elif bool(uniform_rows[at].all()) and stages.dropout == 0:
            effect = (
                f"the fill {stages.fill} makes the weights there uniform (1/{keep.shape[-1]} on every key), "
                "so masked keys are attended to"
            )
        else:
            severity, effect = "suspicious", "the weights there are whatever the fill left"
        findings.append(Finding("fully-masked", f"{_rows(rows, 'see')} no key{plane_text(b, h, keep.shape)}: {effect}", severity))
    return findings


def _min_is_infinite_in_softmax(stages) -> bool:
    """A finfo(dtype).min fill that the float32 softmax reads as -inf (float64's, under --like hf-eager)."""
    import torch

    dtype = stages.scaled.dtype
    return stages.fill == "min" and stages.pipeline.softmax == "float32" and torch.finfo(dtype).min < torch.finfo(torch.float32).min


def _non_finite_findings(stages, keep, q_offset: int) -> tuple:
    """Rows whose scores or scaled scores are not finite, with why; and the (B, H, Lq) flags of those rows.

    Only the cells the softmax reads count: a fill replaces masked ones, multiply reads them all.
    """
    import torch

    dtype = stages.scaled.dtype
    counted = torch.ones((), dtype=torch.bool, device=keep.device) if stages.fill == "multiply" else keep
    broken = (~torch.isfinite(stages.scores) & counted).any(dim=-1)
    has_nan = torch.isnan(stages.scores).any(dim=-1).any(dim=-1).cpu()  # (B, H)
    findings = []
    for b, h, rows in _rows_by_slice(broken, q_offset):
        if bool(has_nan[b, h]):
            what, cause = "NaN", "the inputs carry NaN (or inf times 0)"
        else:
            what = "inf"
            cause = (
                f"Q Kᵀ overflows {_name(dtype)} (largest {torch.finfo(dtype).max:.6g}) or the inputs carry inf; "
                + ("compute in float32 or " if torch.finfo(dtype).bits < 32 else "")
                + "scale the inputs down"
            )
        findings.append(
            Finding("non-finite", f"the scores of query row{'s' if len(rows) > 1 else ''} {spans(rows)} hold {what}{plane_text(b, h, broken.shape)}: {cause}")
        )
    # finite scores that the scale takes past the dtype's range
    overflowed = (~torch.isfinite(stages.scaled) & counted).any(dim=-1) & ~broken
    for b, h, rows in _rows_by_slice(overflowed, q_offset):
        findings.append(Finding(
            "non-finite",
            f"the scaled scores of query row{'s' if len(rows) > 1 else ''} {spans(rows)} hold inf{plane_text(b, h, overflowed.shape)}: "
            f"scores × {stages.scale:.6g} overflows {_name(dtype)} (largest {torch.finfo(dtype).max:.6g}); use a smaller --scale",
        ))
    return broken | overflowed, findings


RULES = (
    Rule("fill-overflow", "wrong", "call", "a -1e9 fill that becomes -inf in the compute dtype", run_findings, "stages"),
    Rule("non-finite", "wrong", "call", "scores that hold NaN or inf", run_findings, "stages"),
    Rule("row-sum", "wrong", "call", "weight rows that do not sum to 1", run_findings, "stages"),
)
