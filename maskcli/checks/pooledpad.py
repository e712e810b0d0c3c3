"""Attention pooling that weighs positions the model call states are padding (a pooling softmax over the pads).

A classification head that pools a padded batch with learned weights, `softmax(weighting_layer(h), dim=1)` then
`sum(weights * h, dim=1)` (or `bmm(weights.unsqueeze(1), h)`, an einsum), normalises the weights over every position:
the pads take weight and the pooled vector of a padded row differs from the same sequence run alone (nbrg-ppcu/prokbert
PR #109: the fix fills the scores at `attention_mask == 0` with -inf before the softmax). trace/poolweights.py keeps,
with the outermost module call that pooled (its Top's `pools`), the (rows, positions) each pooling weighs; that call's
own statement of its padding (real.py's `stated`: its attention_mask, a key padding mask, lengths, the input ids at the
pad id) over as many rows and positions says which are pads. Wrong where a row with real tokens gives a pad weight,
said at the model call's last attention call; quiet where the pads' weights are 0 (filled before the softmax, or no
pads), and where nothing the model call holds states its padding. There, the padding the program's frames held as the
pooling ran says it (a mask named as padding, or lengths, each way they may lie: trace/poolweights.py), and so it does
for a pooling no model call ran, a head called on its own after the model, kept with the attention call before it
(s3prl#579: AttentivePooling added its bool length mask to the logits, +1 on the frames and +0 on the pads).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell
from maskcli.checks.held import readings
from maskcli.checks.real import stated
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def pooled_padding(run: Run) -> list:
    """Each model call's first pooling whose weights reach a position the call states is padding; and each pooling no
    model call ran (kept with the attention call before it) whose weights reach what the program's frames held as
    padding as it pooled, every way that padding may lie."""
    found = []
    for top in run.tops:
        made = run.made_by(top) or _additive(run, top) if top.pools else ()
        for pool in top.pools if made else ():
            hit = _judged(pool, stated(top, *pool["weighed"].shape) or held_by(made, *pool["weighed"].shape),
                          top.arguments.get("pad_id"))
            if hit is not None:
                found.append((made[-1], hit))
                break
    for call in [*run.calls, *run.unmasked, *run.cross]:  # (poolings no model call ran: the program's own padding)
        for pool in call.details.get("loose_pools") or ():
            hit = _judged(pool, None, None)
            if hit is not None:
                found.append((call, hit))
                break
    return found


def _additive(run: Run, top) -> list:
    """The additive attention calls `top` made (trace/poolweights.attended: cross-attention, set apart by engine.py),
    where it made no other: its poolings are those calls'."""
    return [call for call in run.cross if top.first <= call.index < top.end and "additive_pool" in call.details]


def _judged(pool: dict, said: tuple | None, pad_id) -> Finding | None:
    """The finding of a pooling that weighs padding: `said` (real, source, sure), else the frames' padding held as it
    pooled (held_there), seen through every way it may lie; None where the pads take no weight."""
    weighed = pool["weighed"]
    if said is None:
        there = held_there(pool, *weighed.shape)
        if there is None:
            return None
        tables, source, sure = there[0], there[1], True
    else:
        tables, source, sure = [said[0]], said[1], said[2]
    bad = [weighed & ~real & real.any(axis=1, keepdims=True) for real in tables]
    if not all(each.any() for each in bad):
        return None
    return _finding(pool, bad[0], tables[0], source, sure, pad_id)


def _finding(pool: dict, bad: np.ndarray, real: np.ndarray, source: str, sure: bool, pad_id) -> Finding:
    b, k = first_cell(bad)
    return Finding("pooled-over-padding", (
        f"batch row {b}: attention pooling weights, softmaxed over axis {pool['axis']} of their {pool['shape']} and "
        f"applied by {pool['how']}, give position {k} a weight, which the {source} marks as padding ({int(bad.sum())} "
        f"such positions): " + _why(pool["weighed"], real) + ("" if sure else f" (if token id {pad_id} is padding "
                                                                               "there)")),
        None if sure else "suspicious", expected="no pooling weight on a padding position", source=source, cell=(b, 0, k))


def _why(weighed: np.ndarray, real: np.ndarray) -> str:
    """The softmax over the pads as well, or, where no real position of a row that weighs a pad keeps a weight, the
    fill turned round."""
    rows = (weighed & ~real).any(axis=1)
    if (weighed[rows] & real[rows]).any():
        return "the softmax runs over the pads (fill their scores with -inf before it)"
    return ("no real position keeps a weight: the fill hit the real positions and left the pads (the "
            "mask's polarity turned round: fill where it says padding)")


def held_by(made: list, rows: int, length: int) -> tuple[np.ndarray, str, bool] | None:
    """Where the model call's arguments state no padding: the one padding mask its own attention calls held (trace/held.py,
    named as padding where they ran: `key_padding_mask`, True = padding) over as many rows and positions, else None.
    (CSU-MS2 hands `~(arange < num_peaks)` both to its peak attention as `src_key_padding_mask` and to its pooling.)"""
    found = {}
    for call in made:
        for held in call.details.get("held_padding") or ():
            if held["kind"] in ("keep", "pad") and held["rows"].shape == (rows, length):
                tables = readings(held, rows, length)
                if len(tables) == 1:
                    found.setdefault(tables[0].tobytes(), (tables[0], f"{held['name']} its attention calls held"))
    if len(found) != 1:
        return None
    real, source = next(iter(found.values()))
    return real, source, True


def held_there(pool: dict, rows: int, length: int) -> tuple[list, str] | None:
    """Where neither the model call nor its attention calls state the padding: the one padding the program's frames
    held as it pooled (trace/poolweights.py: a mask named as padding, or lengths, over as many rows and positions), each
    way it may lie (lengths: real tokens first or last); None where they hold none, or several that differ, and where
    the weights are not one query's a row (a (B * H, Lq, Lk) softmax pooled by a matmul is attention over its queries,
    whose padded queries may weigh anything)."""
    shape = pool["shape"]
    if int(np.prod([n for at, n in enumerate(shape) if at not in (0, pool["axis"] % len(shape))])) != 1:
        return None  # (weights of many queries a row: attention's, whose padded queries weigh pads on purpose)
    found = {}
    for held in pool.get("held") or ():
        if held["kind"] in ("keep", "pad", "lengths") and len(held["rows"]) in (1, rows):  # (not laid over rows of
            # another axis: LightLLM's decode pools one request's heads in a loop over the requests' lengths)
            tables = readings(held, rows, length)
            if tables:
                found.setdefault(b"".join(t.tobytes() for t in tables), (tables, f"{held['name']} in {held['where']}"))
    return next(iter(found.values())) if len(found) == 1 else None


RULES = (
    Rule("pooled-over-padding", "wrong", "steps", "attention pooling (a softmax's weights over the positions, weighing "
         "the values along them) that gives weight to positions the model call states are padding", pooled_padding),
)
