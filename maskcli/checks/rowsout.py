"""Query rows the program's row mask states masked out, whose attention output still reaches the residual stream.

A cross-attention whose text rows before any image see no image key (Mllama's, Meta's llama-models reference) cannot
hand those rows to the softmax all masked (NaN): `_prepare_cross_attention_mask` multiplies their bias rows by
`full_text_row_masked_out_mask` (0 on them), so they take uniform weights over the image, and the same row mask must
then zero their output. transformers#39379: `MllamaCrossAttentionDecoderLayer` applied it to the MLP branch only, so
`residual + gate.tanh() * attn_out` carried image content into the text tokens before `<|image|>` (the fix, as the
reference does: `full_text_row_masked_out_mask[:, 0] * attn_out` before the gated residual add).

Reads details `row_mask` (trace/rowsout.py): a row mask the call's frames were handed (a name with "row" in it, ending
in `mask`; 0 on the rows it drops), and what became of the call's output: where it was added to a tensor of its own
shape it does not hold (a residual) and that sum was not zeroed on those rows afterwards (`open`), while the call's
mask gives each of those rows every key (its fill row unmasked to uniform weights, as the row mask is made for), the
rows the program states masked out attend and their output reaches the stream: wrong.
Quiet where the output is zeroed on those rows before the sum (the fix), where the sum itself is zeroed afterwards,
where the mask leaves those rows no key (a kernel's 0 there: fully-masked's), and where they see some keys only (a
self-attention layer handed the same row mask: Mllama's self-attention layers take it too, their rows causal).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.real import by_row
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def attended_dropped(cells: np.ndarray, rows: np.ndarray) -> list[tuple[int, int, int]]:
    """(b, q, first key) of each row that `rows` (bool (B, Lq), False: dropped) drops and the (B, Lq, Lk) cells give a
    key, in row-major order."""
    found = []
    for b, q in zip(*np.nonzero(~rows)):
        seen = np.flatnonzero(cells[b, q])
        if len(seen):
            found.append((int(b), int(q), int(seen[0])))
    return found


def _spans(qs: list[int]) -> str:
    parts, start = [], None
    for i, q in enumerate(qs):
        if start is None:
            start = q
        if i + 1 == len(qs) or qs[i + 1] != q + 1:
            parts.append(f"{start}" if start == q else f"{start}-{q}")
            start = None
    return ", ".join(parts)


def rows_reach_residual(run: Run) -> list:
    found, done = [], set()
    for call in [*run.calls, *run.cross, *run.unmasked]:
        said = call.details.get("row_mask")
        if not said or not said.get("open") or (call.mask, said["name"]) in done:
            continue
        cells = keep(call)
        if cells is None:
            continue
        rows = np.broadcast_to(np.asarray(said["rows"], dtype=bool), (call.shape[0], call.shape[2]))
        seen = by_row(cells, call.shape[0])
        hits = attended_dropped(seen, rows)
        if not hits or not all(seen[b, q].all() for b, q, _ in hits):
            continue  # (rows the row mask drops that see only some keys are no fully masked rows unmasked to uniform
            # weights: a self-attention layer handed the same row mask, whose rows before the image see their prefix)
        done.add((call.mask, said["name"]))
        b, q, k = hits[0]
        dropped = [int(x) for x in np.flatnonzero(~rows[b])]
        keys = int(cells.any(axis=1)[b % cells.shape[0], q].sum())
        elsewhere = (" (the program zeroes those rows with it in a branch computed after the sum, not in the sum "
                     "itself)") if said.get("elsewhere") else ""
        found.append((call, Finding("masked-rows-reach-residual", (
            f"query rows {_spans(dropped)} of batch row {b} are 0 in `{said['name']}` ({said['where']}): the program "
            f"states them masked out (no key to see), yet the mask gives each of them every key (query {q}: all {keys}, "
            f"its fill row unmasked to uniform weights) and the attention's output of those rows is added to the residual stream "
            f"unmasked{elsewhere}: they read the keys they were masked from; multiply the attention output by the "
            f"row mask before the residual add"),
            expected=f"batch row {b}: the output of query rows {_spans(dropped)} zeroed before it reaches the residual",
            source=f"`{said['name']}` of {said['where']}, and where the call's output went (a sum with a tensor of "
                   f"its shape)",
            cell=(b, q, k))))
    return found


RULES = (
    Rule("masked-rows-reach-residual", "wrong", "call", "query rows a row mask states masked out (given uniform "
         "weights to avoid NaN) whose attention output reaches the residual stream unzeroed", rows_reach_residual),
)
