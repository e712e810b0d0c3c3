"""A causal mask the attending code holds as None, and a kernel that then attends both ways.

The code that calls the kernel names the mask it hands it `causal_mask` (trace/causalnone.py records where it holds
None): the layer is causal, and None leaves the triangle to the kernel's own flag, as transformers' SDPA paths do on a
batch with no padding (`is_causal = causal_mask is None and q_len > 1`). A square self-attention of several queries
from position 0 whose kernel then masked nothing at all (every query sees every key: no `is_causal`, no mask) dropped
the causal part the name states (adapter-hub/adapters#722: `LlamaSdpaAttentionWithAdapters` called
`F.scaled_dot_product_attention` without `is_causal`, so the LoRA-Llama attended the future on every unpadded batch).
Left alone: a padded batch (its causal mask is a tensor, the other rules judge it), one query (a decode step), a
cache's keys, cross-attention, a kernel that masked anything, and code or a module that says the attention is not
causal (trace/causalnone.py records nothing there).
"""

from __future__ import annotations

from maskcli.checks.context import Run, cross, keep, queries
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def causal_none(run: Run) -> list:
    """The first call per site whose code holds its causal mask as None while its kernel masked nothing."""
    found, sites = [], set()
    for call in run.calls:
        held = call.details.get("causal_none")
        if not isinstance(held, str) or call.where in sites:
            continue
        q_len, k_len = call.shape[2:]
        if q_len != k_len or q_len < 2 or cross(call):
            continue
        top = run.top(call)
        if top is not None and queries(call, top)[0] != 0:
            continue
        cells = keep(call)
        if cells is None or not cells.all():
            continue
        sites.add(call.where)
        found.append((call, Finding("causal-mask-none-unapplied", (
            f"{call.where}: the code that calls the kernel holds its causal mask as None ({held}), which leaves the "
            f"triangle to the kernel's causal flag, yet each of the {q_len} queries sees every key, later ones "
            f"included: no is_causal was passed with the None mask"),
            expected="causal", source=held, cell=(0, 0, 1))))
    return found


RULES = (
    Rule("causal-mask-none-unapplied", "wrong", "steps", "the attending code holds its causal mask as None (the "
         "kernel's is_causal to add it) and the kernel attends every key, later ones included", causal_none),
)
