"""A real query that sees a key holding a pad token of ids the program placed among a joined sequence's keys.

A model that joins token groups into one sequence (pi-zero's images, language and actions) pads its language mask
out to the joined length by hand. What the program states (trace/placedids.py): its module's pad id (`lm_pad_id`,
`pad_id`) and the 2-D ids it holds, whose real tokens' embeddings the attending layer gets at tokens o .. o + T of
the N the layer was handed, the N first among the keys or last: key o + t holds a pad token where ids[b, t] is the
pad id. A query of that row that is no pad token itself and
sees such a key reads padding the program itself calls padding: the mask was padded out at the wrong offset
(pi-zero-pytorch#12: `F.pad(language_mask, (state_length - command_length - 1, 1 + actions))` shifted the language
mask one key left, so the last pad token was attended and a real one hidden). Wrong there, in both places. Quiet where every
pad key of either place is hidden from the real queries, where the ids pad no row, on cross-attention, and where the ids' embeddings are found
nowhere among the layer's input (a layer past the first, the tokens scaled or mixed).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def pad_keys(placed: dict, k_len: int, start: int) -> np.ndarray:
    """Bool (B, Lk): the keys holding a pad token of the placed ids, the layer's N tokens at keys start .. start + N."""
    ids, offset = placed["ids"], start + placed["offset"]
    pads = np.zeros((ids.shape[0], k_len), dtype=bool)
    pads[:, offset:offset + ids.shape[1]] = ids == placed["pad"]
    return pads


def placed_pads_seen(run: Run) -> list:
    """Calls whose non-pad queries see a key the program's placed ids call padding, wherever the layer's tokens sit
    among the keys (first or last): quiet where either place is kept to."""
    found, done = [], {}
    for call in run.calls:
        placed = call.details.get("placed_ids")
        if placed is None or call.stored is None or cross(call) or call.shape[2] != call.shape[3]:
            continue
        rows, k_len = call.shape[0], call.shape[3]
        key = (call.mask, call.shape, placed["ids"].tobytes(), placed["offset"])
        if key in done:
            if done[key] is not None:
                found.append((call, done[key]))
            continue
        done[key] = None
        cells = keep(call)
        if cells is None or cells.shape[0] not in (1, rows) or placed["ids"].shape[0] != rows \
                or placed["width"] > k_len:
            continue
        cells = np.broadcast_to(cells.any(axis=1), (rows, call.shape[2], k_len))
        first = None
        for start in sorted({0, k_len - placed["width"]}):
            pads = pad_keys(placed, k_len, start)
            bad = cells & ~pads[:, :, None] & pads[:, None, :]
            if not bad.any():
                first = None
                break
            first = first or (start, bad)
        if first is None:
            continue
        start, bad = first
        b, q, k = first_cell(bad)
        ids, at = placed["ids"], start + placed["offset"]
        source = f"{placed['name']} in {placed['where']}"
        done[key] = Finding("placed-pads-seen", (
            f"batch row {b}: query {q} sees key {k}, which holds token {k - at} of {source}, the pad id "
            f"{placed['pad']} the module states (its real tokens' embeddings found at keys {at}-{at + ids.shape[1] - 1}"
            f"{', the layer input read first; read last, its pads are seen too' if k_len > placed['width'] else ''}; "
            f"{int(bad.sum())} such "
            f"cells) — the padding mask padded out to the joined length at the wrong offset?"),
            expected=f"no real query sees a key {placed['name']} pads", source=source, cell=(b, q, k))
        found.append((call, done[key]))
    return found


RULES = (
    Rule("placed-pads-seen", "wrong", "call", "a real query that sees a key holding a pad token (the pad id the module "
         "states) of ids whose embeddings the layer gets at known keys of a joined sequence", placed_pads_seen),
)
