"""The kernels' own rules: a hint the kernel reads its own way, a mask in the wrong polarity, fills, rows with no key.

Most of these findings are made where a mask is read (trace's report, inspect, attend); they are
declared here with their severity. The rules written here read the calls of a trace.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep, queries
from maskcli.checks.registry import Rule
from maskcli.text import Finding

REPORT, INSPECT, ATTEND = "maskcli.trace.report", "maskcli.inspect.findings", "maskcli.attention.findings"


FAST = "on its fast path (eval, no grad) it never reads it:"
SLOW = "with a key padding mask or need_weights"


def hint_ignored(run: Run) -> list:
    """is_causal=True said to a kernel that applied a mask letting queries see later keys (MHA reads is_causal as a
    hint about attn_mask and applies attn_mask itself wherever it needs a mask: a key padding mask, need_weights;
    torch/nn/functional.py multi_head_attention_forward)."""
    found, done = [], set()
    for call in run.calls:
        if call.api != "mha" or not call.details.get("is_causal") or call.mask in done or "ignored_is_causal" in call.details:
            continue  # (the fast path's ignored-is-causal says it applied no mask at all)
        done.add(call.mask)
        cells = keep(call)
        if cells is None:
            continue
        top = run.top(call)
        own = queries(call, top)
        later = cells & (np.arange(call.shape[3])[None, :] > own[:, None])
        if later.any():
            b, h, q, k = first_cell(later)
            found.append((call, Finding(
                "hint-ignored", f"is_causal=True is only a hint to nn.MultiheadAttention: "
                f"{FAST if call.details.get('path') == 'fast' else SLOW} it applies attn_mask, and attn_mask lets "
                f"query {int(own[q])} see later key {k}",
                expected="causal", source="is_causal=True", cell=(b, int(own[q]), k))))
    return found


def ones_added(run: Run) -> list:
    """A float attn_mask of 0s and 1s: a keep mask (True = attend) cast to float and added to the scores, which masks
    nothing (SDPA adds a float mask: torch/nn/functional.py scaled_dot_product_attention's docstring)."""
    found, done = [], set()
    for call in run.calls:
        if not call.details.get("zero_one") or call.mask in done:
            continue
        done.add(call.mask)
        found.append((call, Finding(
            "ones-added", "the float attn_mask holds only 0 and 1: a keep mask cast to float is added to the scores, "
            "so it masks nothing (pass it as bool, or as (1 - mask) * finfo.min)", expected="an additive mask: 0 and -inf",
            source=f"{call.api}'s attn_mask, {call.details.get('mask_dtype')}")))
    return found


RULES = (
    Rule("polarity", "suspicious", "call", "a mask that is a known one read the other way round (True = masked given "
         "where True = attend is read)", f"{REPORT}:_named"),
    Rule("top-left-causal", "wrong", "call", "is_causal with fewer queries than keys: SDPA aligns it top-left, so a "
         "decode step behind a cache sees key 0 only", f"{REPORT}:_named"),
    Rule("score-mod", "note", "call", "a flex score_mod that also adds a bias, or whose masking could not be read off "
         "its -inf cells", f"{REPORT}:_named"),
    Rule("same-as", "note", "call", "a mask two expressions name alike (local(C) and document(sizes=...)): the same "
         "cells", f"{REPORT}:_named"),
    Rule("closest", "note", "call", "the expression nearest a mask nothing rebuilds, and where they differ", f"{REPORT}:_named"),
    Rule("bias", "note", "call", "a float mask that also adds a bias (ALiBi, relative positions)", f"{REPORT}:_named"),
    Rule("finite-fill", "note", "call", "scores filled with a finite value where masked: a row filled everywhere gets "
         "uniform weights", f"{REPORT}:_fills"),
    Rule("additive", "note", "call", "an additive mask added to the scores rather than a fill", f"{REPORT}:_fills"),
    Rule("hf-not-causal", "wrong", "call", "Hugging Face asked for a causal mask that the attention function did not "
         "apply", f"{REPORT}:_asked"),
    Rule("hf-not-windowed", "wrong", "call", "Hugging Face asked for a sliding window that the attention function did "
         "not apply", f"{REPORT}:_asked"),
    Rule("ignored-is-causal", "wrong", "call", "is_causal=True on nn.MultiheadAttention's or an encoder layer's fast "
         "path, which never reads it: no mask, or a mask that lets queries see later keys, applied", f"{REPORT}:_named"),
    Rule("hint-ignored", "wrong", "call", "is_causal=True beside a mask that lets queries see later keys: the kernel "
         "applied the mask", hint_ignored),
    Rule("ones-added", "wrong", "call", "a keep mask of 0s and 1s added to the scores as a float mask: nothing is "
         "masked", ones_added),
    Rule("sentinel-overflow", "wrong", "call", "a fill value that is -inf in float16 or bfloat16, so a fully masked row "
         "gives NaN", f"{INSPECT}:findings"),
    Rule("ones-masked", "note", "call", "an integer mask whose 1s mark the masked cells", f"{INSPECT}:findings"),
    Rule("3d-heads", "wrong", "call", "a 3-D mask of one plane per head, which nn.MultiheadAttention reads per batch "
         "row and head", f"{INSPECT}:findings"),
    Rule("3d-shape", "wrong", "call", "a 3-D mask whose first dimension neither SDPA nor MHA accepts", f"{INSPECT}:findings"),
    Rule("heads-mismatch", "wrong", "call", "a 4-D mask whose heads do not broadcast to the model's", f"{INSPECT}:findings"),
    Rule("fill-overflow", "wrong", "call", "a -1e9 fill that becomes -inf in the compute dtype", f"{ATTEND}:run_findings"),
    Rule("non-finite", "wrong", "call", "scores that hold NaN or inf", f"{ATTEND}:run_findings"),
    Rule("row-sum", "wrong", "call", "weight rows that do not sum to 1", f"{ATTEND}:run_findings"),
)
