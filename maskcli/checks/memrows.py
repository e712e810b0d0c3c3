"""Which earlier model call's output row each batch row of a cross-attention's memory is, read by the rows' content.

A pipeline may encode its memory in model calls of its own and hand the decoder a batch made of their outputs
repeated and concatenated: diffusers' PixArt encodes its prompts and classifier-free guidance's negative prompt in
two T5 calls, repeats each per image and hands the transformer `cat([negative, positive])`, so the transformer's
batch rows are neither one encoder call's rows nor a repeat of the latest one's. The rows say it themselves: trace
keeps a hash of each batch row of every small tensor a model call was handed (Top.rows, trace/samplerows.py) and of
each row of an outermost call's output hidden states (its `output_rows`, as returned and cast to the half types:
trace/outrows.py). A row of the cross-attention's model call's argument whose hash is an earlier output row's is
a copy of it: that row's memory is that encoder row's, and its padding that encoder call's (memturned.encoder_padding).
Exact where the pipeline copies (repeat, view, cat, index, a cast): a memory computed from the outputs (a projection
outside the model) matches no row, and the rows are then read as before.
"""

from __future__ import annotations

from typing import NamedTuple

from maskcli.checks.context import Run


class Copied(NamedTuple):
    """Row `row` of the output of `top` (an earlier outermost call), copied as row `at` of the argument `name`."""

    top: object
    row: int
    name: str


def copied_rows(run: Run, call, rows: int, read: dict) -> list | None:
    """[Copied or None] per batch row of `call` (a cross-attention): for the argument of its model call whose rows
    copy the most output rows of earlier model calls that made no cross-attention (the latest such call's row where
    two hold the same), the output row each of its rows copies; None where no argument of `rows` rows copies any."""
    top = run.top(call)
    if top is None or not top.rows:
        return None
    key = ("copied", id(top), rows)
    if key in read:
        return read[key]
    crossing = read.get("tops")
    if crossing is None:
        crossing = read["tops"] = {id(run.top(other)) for other in run.cross}
    outputs: dict = {}  # row hash -> Copied (name left blank), the latest output holding it
    for other in run.tops:
        held = other.arguments.get("output_rows")
        if other is top or not isinstance(held, dict) or other.end > call.index or id(other) in crossing:
            continue
        for hashes in held.values():
            outputs.update({one: Copied(other, row, "") for row, one in enumerate(hashes)})
    best, count = None, 0
    for name, hashes in top.rows if outputs else ():
        if len(hashes) != rows:
            continue
        found = [None if outputs.get(one) is None else outputs[one]._replace(name=name) for one in hashes]
        mapped = sum(one is not None for one in found)
        if mapped > count:
            best, count = found, mapped
    read[key] = best
    return best


def encoder_runs(run: Run, mine, keys: int, read: dict) -> int:
    """How many model calls that made no cross-attention and made a square self-attention over `keys` keys ran back to
    back with `mine` (one of them): no model call that made a cross-attention between them. A memory expanded from
    several such runs (a pipeline's prompts and its negative prompt, encoded apart) is not one run's rows repeated."""
    crossing = read.get("tops")
    if crossing is None:
        crossing = read["tops"] = {id(run.top(other)) for other in run.cross}
    key = ("runs", id(mine), keys)
    if key in read:
        return read[key]
    tops = run.tops
    at = next((i for i, one in enumerate(tops) if one is mine), None)
    count = 0
    if at is not None:
        for step in (-1, 1):
            i = at + step
            while 0 <= i < len(tops) and id(tops[i]) not in crossing:
                count += any(call.shape[2] == call.shape[3] == keys for call in run.made_by(tops[i]))
                i += step
    read[key] = count + 1
    return count + 1
