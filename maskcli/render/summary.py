"""Statistics of a mask in words: visible cells, keys per query row, rows that see nothing, FLOPs."""

from __future__ import annotations

import json

from maskcli.render.masks import shape_text
from maskcli.summary import Summary


def _share(part: int, whole: int) -> str:
    """A percentage that keeps its first digits however small: 24.00%, 0.0122%."""
    if not whole:
        return "-"
    share = 100 * part / whole
    return f"{share:.2f}%" if share >= 0.01 or share == 0 else f"{share:.3g}%"


def _empty(row) -> str:
    if not row.empty_rows:
        return "none"
    shown = ", ".join(f"{a}" if a == z else f"{a}-{z}" for a, z in row.empty_spans)
    listed = sum(z - a + 1 for a, z in row.empty_spans)
    more = f" and {row.empty_rows - listed:,} more" if row.empty_rows > listed else ""
    return f"{row.empty_rows:,} ({shown}{more})"


NAMES = {"chunk": "chunks", "document": "documents", "segment": "segments", "blocks": "blocks"}
MOST_STARTS = 8  # starts named in words (--json lists up to JSON_STARTS)
JSON_STARTS = 1024


def segments(mask, batch: int) -> tuple[str, int, list[int]] | None:
    """('documents', count, starts) of batch row `batch`: the runs of the first labelled kind in the expression
    (for blocks, the runs of ids >= 0), found from the change points in O(n), however many there are."""
    if mask.tree is None:
        return None
    from maskcli import terms

    term = next((t for t in terms.terms(mask.tree) if t.kind.name in NAMES), None)
    if term is None:
        return None
    labels = term.values["labels"].array
    row = labels[batch if labels.shape[0] > 1 else 0]
    from maskcli.render.structure import run_starts

    starts = run_starts(row)
    if term.kind.name == "blocks":
        starts = starts[row[starts] >= 0]
    return NAMES[term.kind.name], int(starts.size), starts[:JSON_STARTS].tolist()


def _segments_line(mask, batch: int) -> str | None:
    found = segments(mask, batch)
    if found is None:
        return None
    name, count, starts = found
    shown = ", ".join(f"{start:,}" for start in starts[:MOST_STARTS])
    more = f" and {count - MOST_STARTS:,} more" if count > MOST_STARTS else ""
    return f"{name}: {count:,}" + (f", starting at {shown}{more}" if count else "")


def summary_text(summary: Summary) -> str:
    mask = summary.mask
    where = "" if mask.frame.is_plain() else f" · {mask.frame.describe()}"
    lines = [f"{mask.title} · {shape_text(mask)}{where}"]
    lines.append(
        f"visible cells: {summary.visible:,} of {summary.total:,} ({_share(summary.visible, summary.total)}) · {summary.how}"
    )
    for row in summary.rows:
        prefix = ""
        if mask.batch > 1:
            lengths = mask.frame.lengths
            length = f" (length {lengths[row.batch if row.batch < len(lengths) else 0]})" if lengths is not None else ""
            prefix = f"batch {row.batch}{length}: "
            over = f" over its {mask.heads:,} heads" if mask.heads > 1 else ""
            lines.append(f"{prefix}visible {row.visible:,} of {row.total:,}{over} ({_share(row.visible, row.total)})")
            prefix = "  "
        median = f"{int(row.keys_median):,}" if row.keys_median == int(row.keys_median) else f"{row.keys_median:,.1f}"
        each = " (every head's)" if mask.heads > 1 else ""
        lines.append(f"{prefix}keys per query row{each}: min {row.keys_min:,} · median {median} · max {row.keys_max:,}")
        what = "rows that see none of the region's keys" if mask.whole is not None else "rows that see no key"
        lines.append(f"{prefix}{what}{each}: {_empty(row)}")
        found = _segments_line(mask, row.batch)
        if found:
            lines.append(f"{prefix}{found}")
    lines.append(
        f"attention FLOPs: 4·D per visible cell = {4 * summary.visible:,}·D, {_share(summary.visible, summary.total)} of dense "
        f"({4 * summary.total:,}·D) for head size D"
    )
    return "\n".join(lines)


def summary_json(summary: Summary) -> str:
    data = summary.json()
    for row in data["batch_rows"]:
        found = segments(summary.mask, row["batch"])
        if found is not None:
            name, count, starts = found
            row[name] = {"count": count, "starts": starts, **({"starts_listed": len(starts)} if count > len(starts) else {})}
    return json.dumps(data)
