"""Shards that all take the same rows of the one square mask the program built over their keys.

A context-parallel rank (Llama 3's all-gathered keys and values: Cornstarch, Megatron's CP, a ring's first step) attends
its shard's Lq queries to all L keys, with the rows of the full (L, L) mask that belong to its own queries, at its
offset: `attention_mask[:, :, start:start + Lq]`. trace/maskrows.py records where a kernel's mask is such a block of
rows of a square mask over the call's L keys ("mask_rows_of": the base tensor's serial, the first row taken, L, whether
another block of Lq rows of it differs). Where n >= 2 calls of one site take blocks of the same base tensor, each with
queries of its own (another query tensor each), n x Lq = L of them (the queries of the L positions, shard by shard),
and every call takes the same rows, while the base's rows differ block by block: at most one shard sits at those rows,
and the others attend with another shard's rows of the mask the program built (Cornstarch#38: every rank took
`mask[:, :, :local_len]`, rank 0's rows).

Quiet where the calls take different rows (each at its own offset, the fix), where the base's row blocks are all the
same (a key padding repeated over the queries: any block is right), where the calls hand the same queries again, and
where their queries do not make up the L positions.
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def same_rows(run: Run) -> list:
    """(call, Finding) once per site and base mask whose shards all take the same block of its rows."""
    found = []
    for where, calls in run.sites().items():
        groups: dict = {}
        for call in calls:
            said = call.details.get("mask_rows_of")
            if said:
                groups.setdefault((said[0], int(said[2]), int(call.shape[2])), []).append(call)
        for (_, length, q_len), taken in groups.items():
            starts = {int(call.details["mask_rows_of"][1]) for call in taken}
            queries = {repr(call.details.get("query_tensor")) for call in taken}
            if len(taken) < 2 or len(starts) != 1 or len(taken) * q_len != length or len(queries) != len(taken) \
                    or "None" in queries or not all(call.details["mask_rows_of"][3] for call in taken):
                continue
            start = starts.pop()
            first, other = taken[0], taken[1] if start == 0 else taken[0]
            at = 1 if start == 0 else 0
            right = at * q_len
            found.append((other, Finding("mask-rows-same-shard", (
                f"{len(taken)} calls of {where} (steps {first.step} .. {taken[-1].step}) each attend {q_len} queries of "
                f"their own to the same {length} keys, {len(taken)} x {q_len} = {length}: the shards of the {length} "
                f"positions; each hands the kernel rows {start} .. {start + q_len - 1} of the one ({length}, {length}) "
                f"mask the program built over those keys, whose blocks of {q_len} rows differ: only one shard's queries "
                f"sit at rows {start} .. {start + q_len - 1}, and the others attend with that shard's rows, not their own "
                f"(each shard's rows start at its own offset: {', '.join(str(i * q_len) for i in range(len(taken)))})"),
                expected=f"call {at + 1} of the shards: rows {right} .. {right + q_len - 1} of the mask",
                source=f"the ({length}, {length}) mask the program built, sliced at {where}")))
    return found


RULES = (
    Rule("mask-rows-same-shard", "wrong", "site", "shards of one sequence (context-parallel ranks over all-gathered "
         "keys) that all take the same block of rows of the one square mask over their keys, not each its own "
         "(Cornstarch#38: every rank took mask[:, :, :local_len])", same_rows),
)
