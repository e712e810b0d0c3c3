"""A traced vLLM engine's steps as the rest of `trace` uses calls: saved, expected, and followed across steps.

Each request of each build() (maskcli/serve/captured.py's Checked) is one call of api "vllm": its mask is the
request's own (queries at seq_len - new .. seq_len - 1 over keys 0 .. seq_len - 1), named by its layer group's
first layer, numbered per layer as trace numbers a module's calls, so `show --mask TRACE.pt:7` and
`TRACE.pt:LAYER@N` read it back. `--expect PATTERN=EXPR` matches a step by any layer its metadata serves and
compares each of its requests at its own positions (key intervals: O(queries) per request). The steps of one
layer group, in order, are one sequence of serve's step files: each request followed across them by its pages.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from maskcli.errors import MaskError


def names(checked) -> tuple[str, ...]:
    """What a pattern matches for one captured step: every layer its metadata serves, else its builder's class."""
    return tuple(checked.captured.layers) or (checked.captured.builder,)


def _where(checked) -> str:
    return names(checked)[0]


def _stored(mask, shape, room: int) -> dict:
    from maskcli import tracefile
    from maskcli.intervals import NotFew

    try:
        stored = tracefile.from_intervals(mask.intervals(), shape, (1, 1))
    except NotFew:  # a draft tree's rows: bits
        stored = tracefile.from_dense(mask.cells(0, 0)[None, None], shape)
    if tracefile.nbytes(stored) > room:
        counts = mask.intervals().counts() if mask.exact else mask.cells(0, 0).sum(axis=-1)
        stored = tracefile.stats_only(shape, int(counts.sum()), int((counts == 0).sum()), "past --max-bytes")
    return stored


def calls(checked: list, first: int, room: int) -> tuple[list[dict], dict[str, dict]]:
    """(call dicts as Call.json() writes them, from index `first` on; the distinct masks they name by digest), one
    call per request with queries; masks past `room` bytes keep their counts only, as trace's own calls do."""
    from maskcli import tracefile

    out, masks, per_where = [], {}, {}
    for c in checked:
        if c.batch is None:
            continue
        b, where = c.batch, _where(c)
        for r in range(b.requests):
            mask = b.mask(r)
            if mask is None:
                continue
            q_start, q_len, seq_len = b.frame(r)
            shape = (1, 1, q_len, seq_len)
            stored = _stored(mask, shape, room)
            room -= tracefile.nbytes(stored)
            key = tracefile.digest(stored)
            masks.setdefault(key, stored)
            step = per_where.get(where, 0)
            per_where[where] = step + 1
            name = f"vllm step {c.captured.step} request {r}"
            out.append({"index": first + len(out), "where": where, "api": "vllm", "step": step, "step_label": name,
                        "shape": list(shape), "q": [], "k": [], "v": [], "dtype": "", "device": "", "mask": key,
                        "details": {"step_name": name, "vllm_step": c.captured.step, "request": r, "builder": c.captured.builder,
                                    "layers": list(c.captured.layers), "queries": [q_start, seq_len], "expression": b.expression(r)}})
    return out, masks


def matched(checked: list, pattern: str) -> list:
    return [c for c in checked if any(fnmatchcase(name, pattern) for name in names(c))]


def expect(checked: list, pattern: str, expression: str) -> list[str]:
    """Lines on the steps `pattern` matches whose requests are not `expression` at their own positions: the first
    differing step's first differing request and cell, then how many steps more; empty where every one holds."""
    from maskcli.checks import registry

    head = f"--expect {pattern}={expression}"
    lines, differing = [], []
    for c in matched(checked, pattern):
        where = f"vllm step {c.captured.step} ({_where(c)})"
        if c.batch is None:
            lines.append(f"{head}: {where}: cannot compare: {c.error}")
            continue
        found = registry.wrong(registry.run("expectations", c.batch, [(pattern, expression)], where=where))
        if not found:
            continue
        differing.append(c.captured.step)
        if len(differing) == 1:
            lines.append(found[0].message)
    if len(differing) > 1:
        from maskcli.text import spans

        lines.append(f"{head}: {len(differing) - 1} more vllm steps differ: {spans(differing[1:])}")
    return lines


def across(checked: list) -> tuple[list[tuple[str, list]], list[str]]:
    """((a layer group, serve's steps findings over its steps: skipped or repeated positions, earlier keys read from
    other pages) for each group of more than one step; notes on groups whose requests could not be followed)."""
    from maskcli.checks import registry

    groups: dict[int, list] = {}
    for c in checked:
        if c.batch is not None:
            groups.setdefault(c.captured.group, []).append(c)
    out, notes = [], []
    for members in groups.values():
        if len(members) < 2:
            continue
        where = _where(members[0])
        try:
            out.append((where, registry.run("request-steps", [c.batch for c in members], [f"vllm step {c.captured.step}" for c in members])))
        except MaskError as error:
            notes.append(f"--api vllm: the steps of {where} were not followed across: {error}")
    return out, notes
