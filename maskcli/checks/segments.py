"""A padded batch attended one sequence at a time, in pieces that are not its rows' real tokens.

A variable-length kernel (flash-attn's `flash_attn_varlen_func`, or a loop of one attention per sequence standing for
it) is handed the batch unpadded: each row's real tokens, packed, with cumulative lengths read off the padding
(transformers' `_upad_input` / `_get_unpad_data`). Each call of one batch row then attends over exactly that row's
real tokens, so one model call makes, at a self-attention site, one call per batch row whose lengths are the
padding's. Where the program holds that padding (trace/held.py: the 2-D `attention_mask` of a function on the
stack, or its lengths) and the site's per-sequence calls are shorter than a row's real tokens, the unpadding read
another mask: Whisper's FlashAttention-2 path sliced the (B, L) mask to `key_states.shape[-2]` = num_heads columns
(transformers#36477), so the segments are cut from the wrong tokens with the wrong boundaries.

Stays quiet where the calls are as long as the rows' real tokens or longer (a loop over the padded rows whole, which
causal attention makes harmless on right padding), where their number is not the batch's, and where the padding is
not a padded batch's (every row real, a hole in a row).
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.held import readings
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def cut_segments(run: Run) -> list:
    """Per-sequence self-attention calls of one model call shorter than the real tokens of the rows the program's
    held padding gives, row by row."""
    found = []
    for top in run.tops:
        sites: dict = {}
        for call in run.made_by(top):
            if call.shape[0] == 1 and call.shape[2] == call.shape[3] and run.top(call) is top:
                sites.setdefault(call.where, []).append(call)
        for calls in sites.values():
            finding = _finding(calls)
            if finding is not None:
                found.extend((call, finding) for call in calls)
    return found


def _finding(calls: list) -> Finding | None:
    if len(calls) < 2:
        return None
    pieces = [int(call.shape[2]) for call in calls]
    helds = {id(h["rows"]): h for call in calls for h in call.details.get("held_padding") or ()}
    for held in helds.values():
        if held["kind"] not in ("keep", "pad", "lengths") or getattr(held["rows"], "ndim", 0) < 1:
            continue
        rows = held["rows"].shape[0]
        length = int(held["rows"].max()) if held["kind"] == "lengths" else held["rows"].shape[-1]
        tables = readings(held, rows, length) if rows == len(calls) else []
        if not tables:
            continue
        real = [int(n) for n in tables[0].sum(axis=1)]  # (each reading has the same count per row)
        cut = [b for b in range(rows) if pieces[b] < real[b]]
        if not cut:
            continue
        b = cut[0]
        said = f"{held['name']} in {held['where']}"
        return Finding("segments-cut", (
            f"{len(calls)} calls attend one sequence each, over {pieces} tokens, but {said} gives the batch's rows "
            f"{real} real tokens: batch row {b}'s {real[b]} are cut to {pieces[b]} — the unpadding (indices, "
            f"cu_seqlens) was read off another mask, sliced or shaped wrong?"),
            expected=f"one call per row over its real tokens: {real}", source=said, cell=(b, pieces[b], pieces[b]))
    return None


RULES = (
    Rule("segments-cut", "wrong", "steps", "a padded batch attended one sequence per call (a varlen kernel's segments) "
         "over fewer tokens than the padding the program holds gives its rows: the unpadding read another mask "
         "(Whisper's FA2 path sliced to num_heads columns)", cut_segments),
)
