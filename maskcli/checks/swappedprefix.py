"""Two inputs laid end to end in one self-attention, the later one causal, whose off-diagonal blocks are swapped.

A model that conditions a generated sequence on another (VALL-E's phonemes before its audio codes, a TTS prompt before
its target, a prompt before a response) lays them end to end in one self-attention: the earlier input padded to its
longest, then the later one. The program states that layout where it holds both inputs' lengths at the call
(trace/held.py: `x_lens` and `y_lens` beside the call, two length vectors whose longest add up to the keys) and states
the later input generated in order where its queries attend it causal (each real query sees its own and every
earlier real token of it, no later one). Its mask then contradicts itself where every real query of the later input
sees no real key of the earlier one while every real query of the earlier one sees keys of the later one: a query
before the whole later input sees its tokens, which the later input's own queries are masked from as their future,
and nothing the later input computes depends on the earlier input at all. That is a prefix mask's two off-diagonal
blocks swapped (lifeiteng/vall-e c611592: `F.pad(..., value=...)` padded the text rows with "see" and the audio rows
with "hide").

Read per batch row, its padding resolved by the held lengths, on every head. Quiet on a prefix LM (the later input
sees the earlier one; the earlier one sees none of the later), on two inputs attended apart (neither sees the other:
packing), on a later input that is not causal among itself, and where the held lengths do not add up to the keys.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans


def _layouts(call):
    """((first name, first lengths), (second name, second lengths)) of two lengths the program holds at the call whose
    longest add up to its keys, in either order (each row's real tokens: the first's from 0, the second's from the
    first's longest)."""
    held = [h for h in call.details.get("held_padding") or () if isinstance(h, dict) and h.get("kind") == "lengths"]
    k_len = call.shape[3]
    found = []
    for i, a in enumerate(held):
        for b in held[i + 1:]:
            ra, rb = np.asarray(a.get("rows")), np.asarray(b.get("rows"))
            if ra.ndim != 1 or rb.ndim != 1 or ra.shape != rb.shape or a.get("name") == b.get("name") \
                    or not ra.size or int(ra.max()) + int(rb.max()) != k_len or min(ra.min(), rb.min()) < 0:
                continue
            found += [((a.get("name"), ra), (b.get("name"), rb)), ((b.get("name"), rb), (a.get("name"), ra))]
    return found


def _swapped(cells: np.ndarray, first: np.ndarray, second: np.ndarray, p: int) -> list | None:
    """[(batch row, an earlier query, a later key it sees)] where every batch row with real tokens in both inputs has
    the two blocks swapped on every head; None where one such row does not. `cells` (b, h, L, L)."""
    rows = len(first)
    if cells.shape[0] not in (1, rows):
        return None
    hits = []
    for r in range(rows):
        xs, ys = np.arange(int(first[r])), p + np.arange(int(second[r]))
        if len(xs) < 1 or len(ys) < 2:
            continue
        plane = cells[0 if cells.shape[0] == 1 else r]  # (h, L, L)
        yy = plane[:, ys][:, :, ys]
        if not (yy == np.tril(np.ones((len(ys), len(ys)), dtype=bool))[None]).all():
            return None  # the later input not causal among itself
        if plane[:, ys][:, :, xs].any():
            return None  # the later input sees the earlier one (a prefix LM)
        sees = plane[:, xs][:, :, ys]
        if not sees.any(axis=-1).all():
            return None  # some earlier query sees none of the later input (attended apart)
        q = int(xs[0])
        hits.append((r, q, int(ys[np.flatnonzero(sees[:, 0].any(axis=0))[-1]])))
    return hits or None


def swapped_blocks(run: Run) -> list:
    """Square self-attention calls over two held inputs laid end to end whose blocks between them are swapped."""
    found = []
    for call in run.calls:
        if cross(call) or call.shape[2] != call.shape[3] or not call.details.get("held_padding"):
            continue
        layouts = _layouts(call)
        cells = keep(call) if layouts else None
        if cells is None:
            continue
        for (name_a, a), (name_b, b) in layouts:
            p = int(a.max())
            hits = _swapped(cells, a, b, p)
            if not hits:
                continue
            r, q, k = hits[0]
            many = len(a) > 1
            found.append((call, Finding("prefix-blocks-swapped", (
                f"the program holds two inputs laid end to end here ({name_a}: {', '.join(str(int(n)) for n in a)} "
                f"token{'s' if many or int(a[0]) != 1 else ''} from key 0, then {name_b}: "
                f"{', '.join(str(int(n)) for n in b)} from key {p}), the second attended causal among itself; but "
                f"its queries see none of the first input's keys, while every query of the first sees the second's "
                f"(batch row {r}: query {q} sees key {k}, which the second input's own queries before it are masked "
                f"from as their future): nothing the second input computes reads the first. The two blocks between the "
                f"inputs are swapped (a prefix mask padded with the other values)?"),
                expected=f"the second input's queries see the first's real keys {spans(list(range(int(a[r]))))}; "
                         f"the first's queries do not see the second's",
                source=f"{name_a} and {name_b} held at the call", cell=(r, q, k))))
            break
    return found


RULES = (
    Rule("prefix-blocks-swapped", "wrong", "call",
         "two inputs the program holds laid end to end (their lengths), the later attended causal, whose later "
         "input sees none of the earlier one while the earlier one sees the later: a prefix mask's off-diagonal "
         "blocks swapped (VALL-E c611592: the text rows padded with 'see', the audio rows with 'hide')",
         swapped_blocks),
)
