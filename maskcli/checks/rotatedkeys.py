"""A cached step's query rotated like a key other than the one its mask places it at.

A decode step whose keys are all rotated again beside its query (trace/rotatedkeys.py: each query's rotary angles
against each key's, no frequency needed) says where the query was rotated: at the position of the key whose angles it
shares. Its mask says where the query is: at the last key it sees, its own, on a site whose prefill was causal (a
query sees the keys up to its own and none after). The two disagree when the step rotated its query at another
position: keras-hub#1544 and #2870 rotated the new token's query with the rotary layer's default `start_index=0`
while the cache's keys were rotated at 0..L-1, so every step's query sat at position 0 and read its keys as the
future. Said per batch row and query where one key or none shares the query's angles; quiet where the site never ran
a causal prefill that let each query see its own key (cross-attention, an encoder, a step that attends only to the
cache before it), where a row sees no key, and where several keys share them (positions repeated).

Also where the queries and the keys of the call's own tokens were rotated by two tables one shift of positions apart
(trace/rotatedkeys.shifted: mlx-lm#1806 rotated Gemma 3n's queries after its batch cache's offset had advanced past the
keys just rotated, L positions on): every query then reads every key as nearer or farther than it is, whatever the mask.
Quiet on a cross-attention (its keys handed as another tensor) and where the two tables differ token to token.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _causal(cells: np.ndarray) -> bool:
    """Square cells in which each row that sees anything sees its own key and none after."""
    seen = cells.any(axis=-1)
    return bool(seen.any()) and not np.triu(cells, 1).any() and bool(np.diagonal(cells, axis1=-2, axis2=-1)[seen].all())


def _causal_prefill(calls: list, before: int) -> bool:
    """Whether a square call of the site before `before` was causal (_causal)."""
    for call in calls:
        if call.index >= before:
            break
        q_len, k_len = call.shape[2], call.shape[3]
        cells = keep(call) if q_len == k_len > 1 else None
        if cells is not None and _causal(cells):
            return True
    return False


def rotated_apart(run: Run) -> list:
    """Decode steps whose query was rotated like a key other than the last one its mask lets it see."""
    found = []
    for calls in run.sites().values():
        said = []
        for call in calls:
            like = call.details.get("rotated_like")
            cells = keep(call) if like else None
            if cells is None or not _causal_prefill(calls, call.index):
                continue
            first, count = np.asarray(like["first"]), np.asarray(like["count"])
            batch = max(call.shape[0], cells.shape[0])
            if first.shape[0] not in (1, batch) or first.shape[1] != call.shape[2]:
                continue
            one = next((f for f in (_row(call, cells[min(row, cells.shape[0] - 1), 0], first[min(row, first.shape[0] - 1)],
                                         count[min(row, first.shape[0] - 1)], row) for row in range(batch)) if f), None)
            if one is not None:
                said.append((call, one))
        found += _once(said)
    return found


def shifted(run: Run) -> list:
    """Calls whose queries and own new keys were rotated one shift of positions apart (trace/rotatedkeys.shifted)."""
    found: dict = {}
    for call in [*run.calls, *run.unmasked]:
        shift = call.details.get("rotated_shift")
        if not shift or _other_tensor(call) or call.shape[3] < call.shape[2]:
            continue
        rows = shift["rows"]
        found.setdefault(call.where, []).append((call, _factors(call, "query-rotated-apart", (
            f"its {rows} queries and the keys of its own {rows} tokens were rotated by two (cos, sin) tables, each "
            f"token's angles turned from one to the other by one same amount in every rotary pair: a shift of "
            f"positions, so every query reads every key as nearer or farther than it is (the queries rotated after a "
            f"cache's offset advanced past the keys, or with other positions than the keys?)"),
            "queries rotated at their own keys' positions")))
    return [one for said in found.values() for one in _once(said)]


def _factors(call, code: str, text: str, expected: str) -> Finding:
    """A finding read off the rotary factors of a call (said of the site, at its first cell)."""
    return Finding(code, f"{call.where} (call {call.index}, step {call.step}): {text}", expected=expected,
                   source=f"the rotary factors at {call.where}", cell=(0, 0, 0, 0))


def _once(said: list) -> list:
    """The first of a site's findings (of a cache's keys: of the run's), saying how many calls are alike (one finding
    a bug, not one a decode step)."""
    if len(said) < 2:
        return said
    call, first = said[0]
    return [(call, replace(first, message=first.message + f" ({len(said)} calls alike)"))]


def _row(call, cells: np.ndarray, first: np.ndarray, count: np.ndarray, row: int) -> Finding | None:
    for query in range(cells.shape[0]):
        seen = np.flatnonzero(cells[query])
        if not seen.size or count[query] > 1 or first[query] == seen[-1]:
            continue
        at, own = int(first[query]), int(seen[-1])
        like = (f"was rotated like key {at} (its angles in every rotary pair are that key's)" if count[query] else
                f"was rotated at a position none of the call's {call.shape[3]} keys was rotated at")
        return Finding("query-rotated-apart", (
            f"{call.where} (call {call.index}, step {call.step}): batch row {row}'s query {query} {like}, but its mask "
            f"places it at key {own}, the last it sees, on a site whose prefill was causal: the query and its own key "
            f"were rotated at different positions, so it reads its keys as nearer or farther than they are (a rotary "
            f"call left at its default start, or handed the cache's length after the step's key was added?)"),
            expected=f"the query rotated like key {own}", source=f"the rotary factors at {call.where}",
            cell=(row, 0, query, own))
    return None


def _other_tensor(call) -> bool:
    """The call's keys were handed as another tensor than its queries (trace/crossing.py): a cross-attention's, whose
    keys need not be the query's own sequence (Kronos's dependency layer rotates them with its one query's row)."""
    said = call.details.get("cross")
    return isinstance(said, dict) and bool(said.get("cross"))


def one_position(run: Run) -> list:
    """Calls whose causal queries, or a cached step's keys, were all rotated at one position (trace/rotatedkeys.flat)."""
    found: dict = {}
    flat = [call for call in [*run.calls, *run.unmasked] if call.details.get("rotated_flat")]
    grown = {call.shape[3] for call in flat if call.shape[3] > call.shape[2] and call.shape[3] in call.details["rotated_flat"]}
    for call in flat:
        counts = call.details["rotated_flat"]
        q_len, k_len = call.shape[2], call.shape[3]
        cells = keep(call)
        if cells is not None and q_len in counts and q_len == k_len and _causal(cells):
            which = f"its {q_len} queries and keys, which its causal mask orders,"
        elif k_len in counts and k_len > q_len and len(grown) > 1 and not _other_tensor(call):
            which = (f"its {k_len} keys, its own sequence's (at {len(grown)} key counts of the run every key was so "
                     f"rotated: a sequence that grows, not a count of heads),")
        else:
            continue
        found.setdefault(call.where if q_len == k_len else "", []).append((call, _factors(call, "rotated-at-one-position", (
            f"{which} were all rotated by one (cos, sin) row broadcast over them: every token at one position, so the "
            f"rotation says nothing of their order (a rotary table sized by another axis than the tokens', or built "
            f"for one token and applied to many?)"), "a rotary row per token, at its position")))
    return [one for said in found.values() for one in _once(said)]


RULES = (
    Rule("rotated-at-one-position", "wrong", "site", "queries ordered by a causal mask, or a cached step's keys, all "
         "rotated by one rotary row broadcast over them (one position for every token)", one_position),
    Rule("query-rotated-apart", "wrong", "site", "a query rotated at another position than its own key: a cached step's "
         "query against the key its mask places it at, or a call's queries a shift of positions from its own new keys",
         lambda run: rotated_apart(run) + shifted(run)),
)
