"""Keys a varlen path packed out of a padded batch at positions its own mask marks both ways (trace/gathered.py).

An unpadding path (flash-attn varlen, a kernel fed one sequence at a time) gathers each sequence's keys and masks nothing
after: the gather is the mask. trace matches the kernel's key rows, by value, to the padded key tensor a program frame
holds beside a mask over the same (B, Lk). Keys of one row taken at positions the mask keeps and at positions it masks
follow that mask neither way round: a real query sees a key the program calls padding (read True = keep; or, True =
masked, the same contradiction). Said with the mask's positions the gather left out. Wrong: the program's own mask, at the
frame that packed the keys, says otherwise (diffusers#14115: `key[b, :attn_mask.sum()]`, the kept keys taken as a prefix
of a [text, image] sequence whose text padding sits in the middle). Quiet where the keys taken are all of one mark.
"""

from __future__ import annotations

from maskcli.checks.context import Run
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _spans(positions: list[int]) -> str:
    """'0-1, 6-9' of sorted positions."""
    out, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            out.append(str(start) if start == p else f"{start}-{p}")
            start = None
    return ", ".join(out) or "none"


def gathered_across(run: Run) -> list:
    """Calls whose keys were gathered from one padded row at positions its mask marks both ways."""
    found, done = [], set()
    for call in [*run.calls, *run.cross, *run.unmasked]:
        got = call.details.get("gathered_keys")
        if not got:
            continue
        key = (got["mask"], got["row"], tuple(got["taken"]))
        if key in done:
            continue
        done.add(key)
        taken, marked = got["taken"], set(got["marked"])
        masked = [p for p in taken if p not in marked]
        left = [p for p in sorted(marked) if p not in set(taken)]
        found.append((call, Finding("keys-gathered-across-mask", (
            f"{call.where}'s {call.api} was handed {len(taken)} keys packed from {got['keys']} (batch row {got['row']}: "
            f"positions {_spans(taken)}), but {got['mask']} marks {_spans(sorted(marked & set(taken)))} of them one "
            f"way and {_spans(masked)} the other: read either way round, every query sees keys the mask calls padding"
            + (f"; {'position' if len(left) == 1 else 'positions'} {_spans(left)}, marked as the first, "
               f"{'is' if len(left) == 1 else 'are'} left out" if left else "")
            + " (the kept keys taken as a prefix, not where the mask keeps them?)"),
            expected=f"the keys {got['mask']} keeps", source=got["mask"], cell=(got["row"], 0, masked[0]))))
    return found


def gathered_rows(run: Run) -> list:
    """Calls whose keys were gathered from several rows of a padded batch, a query of one seeing a key of another."""
    found, done = [], set()
    for call in [*run.calls, *run.cross, *run.unmasked]:
        got = call.details.get("gathered_rows")
        if not got or (got["mask"], tuple(got["rows"])) in done:
            continue
        done.add((got["mask"], tuple(got["rows"])))
        (i, qb, qp), (j, kb, kp) = got["query"], got["key"]
        rows = ", ".join(str(r) for r in got["rows"])
        found.append((call, Finding("keys-of-another-row", (
            f"{call.where}'s {call.api} was handed {call.shape[3]} keys packed from {got['keys']}, of batch rows {rows}, "
            f"and its query {i} (batch row {qb}, position {qp}) sees its key {j} (batch row {kb}, position {kp}); "
            f"{got['count']} such cells: {got['mask']} holds those rows apart, yet one attention runs over them "
            f"together (the packed sequences' boundaries, cu_seqlens, lost: rows merged into one?)"),
            expected="each row's keys alone", source=got["mask"], cell=(0, i, j))))
    return found


RULES = (
    Rule("keys-of-another-row", "wrong", "call", "a kernel's keys packed (varlen, unpadded) from several rows of a "
         "padded batch that the program's own mask holds apart, a query of one row seeing a key of another",
         gathered_rows),
    Rule("keys-gathered-across-mask", "wrong", "call", "a kernel's keys packed (varlen, unpadded) from a padded key "
         "tensor at positions the program's own mask marks both ways: the gather follows the mask neither way round",
         gathered_across),
)
