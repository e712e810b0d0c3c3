"""A self-attention's padding laid on the query axis: the padded query rows see nothing, the real ones see the pads.

A function of the program on the stack when attention runs holds this batch's padding (trace/held.py: a mask named as
one, `attention_mask` / `input_mask` 1 = real, `*padding_mask` True = padding). In a self-attention a position is a
query and a key at once: where the kernel's mask hides every key from exactly the query rows that padding calls
padding, and keeps the padding's keys for the real query rows, the mask was broadcast along the wrong axis
(`mask[:, None, :, None]`, (B, 1, L, 1), where the keys' `mask[:, None, None, :]` was meant):
huggingface/transformers#23974, Pix2Struct's vision encoder, whose real patches attended the zero padding patches.

A token mask the program's functions are handed under a `<what>_mask` name (trace/namedmasks.py: NeMo's `query_mask`
and `x_mask`, VITS's (B, 1, L) `x_mask`) is read too, either way round: NVIDIA-NeMo/Speech#14836, MagpieTTS's
`query_mask[:, None, :, None]`, whose text encoder's real tokens attended the padded ones.

What makes the statement firm: the mask itself agrees with the held padding, query row for query row (every padded
query row sees no key, every real one sees some), so the padding is this call's positions and the program meant to
mask it; only its axis is wrong. No batch row need be whole (a processor pads every image to `max_patches`).
Left alone: cross-attention (its queries' padding is not its keys': a decoder's padded rows over an encoder's memory),
calls whose queries are not the keys' positions (a decode step), a mask that also hides the padding keys (an outer
product of both paddings is right), and a batch folded with other rows, which this reading does not unfold.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep, queries
from maskcli.checks.held import edge_runs
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def _real(held: dict, rows: int, length: int) -> np.ndarray | None:
    """Bool (rows, length) real positions of a held padding mask over exactly this call's rows and keys; None else."""
    table = held["rows"]
    if held["kind"] not in ("keep", "pad") or table.ndim != 2 or table.shape != (rows, length):
        return None
    real = table.astype(bool) if held["kind"] == "keep" else ~table.astype(bool)
    return real if edge_runs(real, right_only=held["name"] == "mask") else None


def _stated(details: dict) -> list:
    """The held padding, then each token mask handed under a `<what>_mask` name read both ways round."""
    named = [{**mask, "kind": kind} for mask in details.get("named_masks") or () for kind in ("keep", "pad")]
    return [*(details.get("held_padding") or ()), *named]


def padding_on_queries(run: Run) -> list:
    """Self-attention calls whose fully hidden query rows are exactly a held padding's padded positions while their
    real query rows see that padding's keys."""
    found, done = [], {}
    for call in run.calls:
        helds = _stated(call.details)
        rows, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        if not helds or call.stored is None or q_len != k_len or cross(call):
            continue
        key = (call.mask, call.shape, tuple(id(h["rows"]) for h in helds))
        if key not in done:
            done[key] = _finding(run, call, helds, rows, k_len)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(run: Run, call, helds: list, rows: int, length: int) -> Finding | None:
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, rows):
        return None
    if not (queries(call, run.top(call)) == np.arange(length)).all():
        return None
    cells = np.broadcast_to(cells.any(axis=1), (rows, length, length))  # (a cell any head sees)
    sees_any = cells.any(axis=2)  # (rows, Lq)
    for held in helds:
        real = _real(held, rows, length)
        if real is None or not np.array_equal(sees_any, real):
            continue  # (the hidden query rows are not this padding's: another statement, or none)
        bad = cells & real[:, :, None] & ~real[:, None, :]
        if not bad.any():
            continue  # (the padding keys are hidden too: both axes masked, which is right)
        b, q, k = first_cell(bad)
        said = f"{held['name']} in {held['where']}"
        pads = spans([int(p) for p in np.flatnonzero(~real[b])])
        return Finding("padding-on-queries", (
            f"batch row {b}: the query rows {said} calls padding ({pads}) see no key, yet real query {q} sees the padding "
            f"key {k} ({int(bad.sum())} such cells): the padding mask was laid on the query axis ([:, None, :, None]) "
            f"instead of the keys' ([:, None, None, :])"),
            expected="no real query sees a key the padding calls padding", source=said, cell=(b, q, k))
    return None


RULES = (
    Rule("padding-on-queries", "wrong", "call", "a self-attention whose hidden query rows are exactly the padding the "
         "program's frames hold (a padding mask, or a token mask handed as `x_mask` / `query_mask`) while its real "
         "queries see the padding keys (the mask broadcast along the query axis: transformers#23974, "
         "NeMo/Speech#14836)", padding_on_queries),
)
