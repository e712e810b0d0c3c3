"""One module's two attention paths over the same mask that make its rows with no key two different things.

A module with two paths to the same attention (a `use_sdpa` / `flash` / `fused` flag: F.scaled_dot_product_attention
on one side, its own softmax of q @ kᵀ on the other) states by having both that they compute the same thing. Where the
program runs both over the same mask (a parity check, a fallback taken for the attention weights), they differ only in
how each fills the masked cells, and that matters on query rows that see no key (a padded phoneme's row under a
query-and-key padding mask): a finite fill (-1e4, finfo.min) gives such a row uniform weights over every key; an -inf
fill makes it a softmax of nothing, NaN out of a softmax of the program's own and out of SDPA on a backend or a
torch without a safe softmax (0 out of this one's). The program's other path states what those rows are, and the
one filled -inf contradicts it (Stylish-TTS 6cb2c17: the SDPA path filled `-inf` where the manual path fills `-1e4`;
padded rows went NaN and, times the padding mask's 0, spread through the next convolution).

Read on calls of one module over the same kept cells by two kernels (SDPA or MHA on one side, a softmax on the other: one
kernel handed two fills, a training mask filled -inf beside an eval one filled finfo.min, is one path); quiet where
both paths fill alike, where
neither leaves a row with no key, where the -inf path's rows are zeroed after its softmax (the program then makes them 0 on
purpose), and on a bool mask (its masked cells are the kernel's own fill).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.own import same_cells
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def _zeroed(call) -> bool:
    details = call.details
    return bool(details.get("zeroed_after") or details.get("zeroed_output"))


def _infinite(call) -> bool:
    """Its rows with no key are -inf in every cell: NaN out of a softmax without a safe path."""
    details = call.details
    if call.api == "softmax":
        return details.get("fill") == "-inf" and bool(details.get("nan_rows", True)) and not _zeroed(call)
    return call.api in ("sdpa", "mha") and bool(details.get("nan_rows")) and not details.get("finite_rows")


def _finite(call) -> bool:
    """Its rows with no key hold a finite fill: uniform weights over every key."""
    details = call.details
    if call.api == "softmax":
        return details.get("fill") in ("finite", "min") and not _zeroed(call) and not details.get("sink_column")
    return call.api in ("sdpa", "mha") and bool(details.get("finite_rows")) and not details.get("nan_rows")


def _what(call) -> str:
    if call.api == "softmax":
        return "NaN (a softmax of all -inf)"
    return (f"0 out of this {call.api.upper()} (its safe softmax), NaN on a backend or a torch without one (the "
            f"float mask is -inf in every cell of those rows)")


def paths_differ(run: Run) -> list:
    """A call of a module whose rows with no key are -inf where another call of the same module over the same kept
    cells fills them with a finite value."""
    sites: dict = {}
    for call in run.calls:
        if call.stored is not None and call.api in ("softmax", "sdpa", "mha"):
            sites.setdefault(call.where, []).append(call)
    found = []
    for where, calls in sites.items():
        inf = [c for c in calls if _infinite(c)]
        fin = [c for c in calls if _finite(c)]
        if not inf or not fin:
            continue
        for call in inf:
            cells = keep(call)
            if cells is None:
                continue
            empty = ~cells.any(axis=-1)  # (b, h, Lq)
            if not empty.any():
                continue
            other = next((o for o in fin if o.api != call.api and o.shape == call.shape and (kept := keep(o)) is not None
                          and same_cells(kept, cells)), None)  # (two paths: one kernel filled two ways is one path,
            # RePlay's SASRec masking -inf in training and finfo.min in eval through one nn.MultiheadAttention)
            if other is None:
                continue
            b = int(np.argwhere(empty.any(axis=1))[0][0])
            rows = np.flatnonzero(empty[b].any(axis=0)).tolist()
            fill = other.details.get("fill_value")
            fill = f"{fill:g}" if isinstance(fill, (int, float)) else "the dtype's lowest value" \
                if other.details.get("fill") == "min" else "a finite value"
            found.append((call, Finding("empty-rows-differ", (
                f"{where} attends this mask along two paths: on its {call.api} path its query rows "
                f"{spans(rows[:200])} of batch row {b}, which see no key, are {_what(call)}; its {other.api} path "
                f"(call {other.index}) fills the same cells with {fill}, so there those rows get uniform weights over "
                f"every key. The module's two paths disagree on those rows: fill them with a finite value as the other "
                f"path does, or give them a key"),
                expected=f"the rows its {other.api} path gives uniform weights (a finite fill)",
                source=f"the {other.api} path of {where} (call {other.index})", cell=(b, rows[0], 0))))
    return found


RULES = (
    Rule("empty-rows-differ", "wrong", "site",
         "one module's two attention paths over the same mask whose query rows that see no key differ: an -inf fill "
         "(NaN, or 0 under a safe softmax) on one, a finite fill (uniform weights) on the other (Stylish-TTS 6cb2c17)",
         paths_differ),
)
